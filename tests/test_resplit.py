"""Re-splitting a phase mid-epoch (a lost worker): every sample still once per epoch.

Pure: no cluster. The steps trained before the commit keep their samples; the
steps after it, split over other replicas, read exactly the rest of the epoch.
"""

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow.io import replica_streams
from dataflow.planning.plan import phase_steps, resplit_steps
from dataflow.schedule import PhaseSpec
from dataflow.schedule.balance import Even


def _steps(n, batch, replicas, epochs=2, drop_last=False):
    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=epochs, global_batch=batch)
    return phase_steps(
        num_samples=n,
        phase=phase,
        split=lambda size: Even().split(size, replicas, []),
        drop_last=drop_last,
    )


def _samples_per_epoch(segments, n, chunk, seed=3):
    """Per epoch, every sample index read, over the segments (steps, commit) in order."""
    seen: dict[int, list[int]] = {}
    for steps, stop in segments:
        for spec, parts in replica_streams(steps, num_samples=n, chunk_samples=chunk, seed=seed):
            if spec.index >= stop:
                break
            assert [len(p) for p in parts] == list(spec.local_batches)
            seen.setdefault(spec.epoch, []).extend(np.concatenate(parts).tolist())
    return seen


def test_resplit_mid_epoch_reads_the_rest_of_the_epoch_once():
    n, chunk = 103, 8
    steps = _steps(n, batch=12, replicas=3)
    commit = 4  # in the middle of epoch 0 (9 steps per epoch)
    rest = resplit_steps(steps, commit, lambda size: Even().split(size, 2, []))
    assert [s.index for s in rest] == [s.index for s in steps if s.index >= commit]
    assert all(len(s.local_batches) == 2 for s in rest)
    assert [s.global_batch for s in rest] == [s.global_batch for s in steps[commit:]]
    # the epoch in progress remembers the old split; the next epoch starts afresh
    assert rest[0].earlier_splits == (((35, 34, 34), (16, 16, 16)),)
    assert all(s.earlier_splits == () for s in rest if s.epoch == 1)
    seen = _samples_per_epoch([(steps, commit), (rest, 10**9)], n, chunk)
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(n)), epoch


def test_two_failures_in_one_epoch_and_one_at_an_epoch_boundary():
    n, chunk = 200, 16
    steps = _steps(n, batch=20, replicas=4, epochs=3)  # 10 steps per epoch
    first = resplit_steps(steps, 3, lambda size: Even().split(size, 3, []))
    second = resplit_steps(first, 7, lambda size: Even().split(size, 1, []))
    assert len(second[0].earlier_splits) == 2
    third = resplit_steps(second, 20, lambda size: Even().split(size, 2, []))  # epoch 2 start
    assert third[0].earlier_splits == ()
    seen = _samples_per_epoch([(steps, 3), (first, 7), (second, 20), (third, 10**9)], n, chunk)
    for epoch in range(3):
        counts = Counter(seen[epoch])
        assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}, epoch


def test_resplit_keeps_drop_last_leftovers_unused():
    n = 50
    steps = _steps(n, batch=8, replicas=2, drop_last=True)  # 6 steps, 2 samples unused
    rest = resplit_steps(steps, 2, lambda size: Even().split(size, 3, []))
    seen = _samples_per_epoch([(steps, 2), (rest, 10**9)], n, chunk=5)
    assert len(seen[0]) == len(set(seen[0])) == 48


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(5, 120),
    chunk=st.integers(1, 17),
    batch=st.integers(1, 30),
    widths=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    commits=st.lists(st.integers(0, 40), min_size=1, max_size=3),
)
def test_any_sequence_of_resplits_reads_each_sample_once_per_epoch(
    n, chunk, batch, widths, commits
):
    batch = min(batch, n)
    steps = _steps(n, batch=batch, replicas=widths[0])
    segments = []
    for width, commit in zip(widths[1:], sorted(commits), strict=False):
        if steps and commit < steps[0].index:
            commit = steps[0].index
        segments.append((steps, commit))
        rest = resplit_steps(steps, commit, lambda size, w=width: Even().split(size, w, []))
        if not rest:
            steps = ()
            break
        steps = rest
    if steps:
        segments.append((steps, 10**9))
    seen = _samples_per_epoch(segments, n, chunk)
    for epoch, samples in seen.items():
        assert sorted(samples) == list(range(n)), epoch
