import pytest
from hypothesis import given
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.schedule.balance import Even, Proportional, proportional_split
from dataflow.stages.buckets import assign_buckets


@given(
    total=st.integers(0, 10_000),
    weights=st.lists(st.floats(0, 100), min_size=1, max_size=16).filter(lambda w: sum(w) > 0),
)
def test_split_sums_and_is_proportional(total, weights):
    shares = proportional_split(total, weights)
    assert sum(shares) == total and len(shares) == len(weights)
    exact = [w / sum(weights) * total for w in weights]
    assert all(abs(s - e) < 1 + 1e-9 for s, e in zip(shares, exact, strict=True))
    assert all(s == 0 for s, w in zip(shares, weights, strict=True) if w == 0)


def test_even_and_proportional():
    assert Even().split(10, 3) == (4, 3, 3)
    assert Proportional((3, 29)).split(32, 2) == (3, 29)
    assert Proportional((3, 29)).split(4, 2) == (0, 4)  # a zero-sample replica


def test_proportional_errors_name_the_fix():
    with pytest.raises(dfl.ConfigError, match="one weight per replica"):
        Proportional((1, 1)).split(8, 3)
    with pytest.raises(dfl.ConfigError, match="positive sum"):
        Proportional((0, 0))


@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    cap=st.integers(1, 20_000),
    two_dtypes=st.booleans(),
)
def test_buckets_cover_every_parameter_once_within_the_cap(sizes, cap, two_dtypes):
    keys = [i % 2 if two_dtypes else 0 for i in range(len(sizes))]
    buckets = assign_buckets(sizes, keys, cap_bytes=cap)
    flat = sorted(i for b in buckets for i in b)
    assert flat == list(range(len(sizes)))
    for bucket in buckets:
        assert len({keys[i] for i in bucket}) == 1
        assert len(bucket) == 1 or sum(sizes[i] for i in bucket) <= cap


def test_buckets_start_from_the_last_parameter():
    assert assign_buckets([4, 4, 4, 4], [0] * 4, cap_bytes=8) == [[3, 2], [1, 0]]


def test_first_bucket_is_small_so_communication_starts_early():
    mib = 1 << 20
    buckets = assign_buckets([mib // 2] * 8, [0] * 8, cap_bytes=25 * mib)
    assert buckets == [[7, 6], [5, 4, 3, 2, 1, 0]]  # 1 MiB first, then up to 25 MiB
    two_keys = assign_buckets([mib] * 4, [0, 1, 0, 1], cap_bytes=25 * mib)
    assert two_keys == [[3], [2], [1], [0]]  # each key gets its own small first bucket
