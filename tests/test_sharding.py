from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.io.sharding import chunk_sizes, shard_epoch
from dataflow.schedule.balance import proportional_split


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 400),
    chunk=st.integers(1, 50),
    weights=st.lists(st.integers(0, 5), min_size=1, max_size=6).filter(lambda w: sum(w) > 0),
    used=st.floats(0.5, 1.0),
    buffer_chunks=st.integers(1, 5),
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
)
def test_each_sample_at_most_once_whole_chunks_and_bounded_buffer(
    n, chunk, weights, used, buffer_chunks, seed, epoch
):
    sizes = chunk_sizes(n, chunk)
    shares = proportional_split(int(n * used), weights)
    shards = shard_epoch(sizes, shares, seed=seed, epoch=epoch, buffer_chunks=buffer_chunks)
    assert [len(s) for s in shards] == list(shares)
    counts = Counter(np.concatenate(shards).tolist())
    assert all(c == 1 for c in counts.values()) and len(counts) == sum(shares)
    if sum(shares) == n:  # nothing dropped: every sample exactly once
        assert sorted(counts) == list(range(n))
    # Whole chunks: (replica, chunk) pairs exceed the chunks read by at most W - 1.
    pairs = {(r, i // chunk) for r, s in enumerate(shards) for i in s.tolist()}
    chunks_read = {c for _, c in pairs}
    assert len(pairs) <= len(chunks_read) + len(shares) - 1
    # The shuffle buffer: each group of buffer_chunks * chunk positions spans at most
    # buffer_chunks + 2 chunks (its edges may cut two chunks, the short last chunk adds one).
    group = buffer_chunks * chunk
    for s in shards:
        for lo in range(0, len(s), group):
            assert len({i // chunk for i in s[lo : lo + group].tolist()}) <= buffer_chunks + 2


def test_seeded_by_seed_and_epoch():
    sizes = chunk_sizes(100, 10)
    a = shard_epoch(sizes, [60, 40], seed=1, epoch=0)
    b = shard_epoch(sizes, [60, 40], seed=1, epoch=0)
    c = shard_epoch(sizes, [60, 40], seed=1, epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_without_shuffle_replicas_read_consecutive_chunks_in_store_order():
    shards = shard_epoch(chunk_sizes(10, 3), [4, 6], seed=0, epoch=0, shuffle=False)
    assert [s.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]


def test_asking_for_more_than_the_dataset():
    with pytest.raises(dfl.ConfigError, match="sum 11\\) from 10"):
        shard_epoch(chunk_sizes(10, 3), [5, 6], seed=0, epoch=0)
