from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.planning.plan import Plan, phase_steps, steps_per_window
from dataflow.schedule import PhaseSpec
from dataflow.schedule.balance import Proportional, proportional_split

STAGES = ("Load", "Forward", "Backward", "AllReduce", "Update")


def phase(batch: int, epochs: int = 1) -> PhaseSpec:
    return PhaseSpec(index=0, start_epoch=0, end_epoch=epochs, global_batch=batch)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 300),
    chunk=st.integers(1, 40),
    weights=st.lists(st.integers(0, 5), min_size=1, max_size=6).filter(lambda w: sum(w) > 0),
    drop_last=st.booleans(),
    seed=st.integers(0, 3),
)
def test_every_sample_once_per_epoch_for_any_split(n, batch, chunk, weights, drop_last, seed):
    batch = min(batch, n)
    steps = phase_steps(
        num_samples=n,
        phase=phase(batch, epochs=2),
        split=lambda size: proportional_split(size, weights),
        drop_last=drop_last,
    )
    streams = list(dfl.io.replica_streams(steps, num_samples=n, chunk_samples=chunk, seed=seed))
    for epoch in (0, 1):
        seen = Counter()
        for spec, parts in (item for item in streams if item[0].epoch == epoch):
            assert sum(spec.local_batches) == spec.global_batch
            assert [len(p) for p in parts] == list(spec.local_batches)  # sizes as planned
            for part in parts:
                seen.update(part.tolist())
        expected = n - n % batch if drop_last else n
        assert sum(seen.values()) == expected
        assert all(count == 1 for count in seen.values())
        assert [s.last_in_epoch for s in steps if s.epoch == epoch][-1]


def test_short_last_step_is_kept_or_dropped():
    kept = phase_steps(num_samples=10, phase=phase(4), split=lambda s: (s,))
    assert [s.global_batch for s in kept] == [4, 4, 2]
    dropped = phase_steps(num_samples=10, phase=phase(4), split=lambda s: (s,), drop_last=True)
    assert [s.global_batch for s in dropped] == [4, 4]


def test_batch_larger_than_dataset_is_refused():
    with pytest.raises(dfl.BatchSizeError, match=r"global batch size 11 .*\(10 samples\)"):
        phase_steps(num_samples=10, phase=phase(11), split=lambda s: (s,))


def test_phase_rejects_nonpositive_batch():
    with pytest.raises(dfl.BatchSizeError, match="global_batch must be > 0"):
        phase(0)


@pytest.mark.parametrize(
    ("step_seconds", "expected"), [(None, 1), (0.3, 4), (2.0, 1), (1e-6, 10_000)]
)
def test_steps_per_window_reaches_the_target(step_seconds, expected):
    assert steps_per_window(step_seconds, 1.0, 10_000) == expected


@given(
    n_steps=st.integers(1, 200),
    step_seconds=st.floats(1e-4, 3.0),
    replicas=st.integers(1, 4),
)
def test_windows_tile_the_steps_and_tasks_chain(n_steps, step_seconds, replicas):
    steps = phase_steps(
        num_samples=n_steps * 4,
        phase=phase(4),
        split=lambda s: Proportional((1.0,) * replicas).split(s, replicas),
    )
    plan = Plan.build(STAGES, phase(4), steps, replicas, step_seconds=step_seconds)
    covered = [i for w in plan.windows for i in range(w.first, w.stop)]
    assert covered == list(range(len(steps)))
    size = steps_per_window(step_seconds, 1.0, 10_000)
    assert all(w.n_steps == size for w in plan.windows[:-1])
    tasks = plan.tasks()
    assert len(tasks) == len(plan.windows) * replicas
    assert len({t.key for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.key.startswith(f"Load+Forward+Backward+AllReduce+Update@replica{t.replica}-")
    for r in range(replicas):  # each replica's tasks in window order: each runs after the last
        mine = [t.window.index for t in tasks if t.replica == r]
        assert mine == list(range(len(plan.windows)))


def test_plan_prints_and_draws():
    steps = phase_steps(
        num_samples=64, phase=phase(8, epochs=3), split=lambda s: (s - s // 2, s // 2)
    )
    plan = Plan.build(STAGES, phase(8, epochs=3), steps, 2, step_seconds=0.25)
    text = str(plan)
    assert "24 steps" in text and "6 window(s) of [4] steps" in text and "12 tasks" in text
    dot = plan.to_dot()
    assert '"r0w0" -> "r0w1"' in dot and "allreduce" in dot


def test_plan_rejects_split_of_wrong_width():
    steps = phase_steps(num_samples=8, phase=phase(4), split=lambda s: (s,))
    with pytest.raises(dfl.ConfigError, match="split over 1 replicas, the plan has 2"):
        Plan.build(STAGES, phase(4), steps, 2)


def test_plan_header_reads_once_and_lists_splits_in_step_order():
    """The default tag is not printed twice ("Plan plan phase 0"), and the short last
    step's split comes after the full steps' one (it was sorted first)."""
    steps = phase_steps(num_samples=70, phase=phase(16), split=lambda s: (s - s // 2, s // 2))
    text = str(Plan.build(STAGES, phase(16), steps, 2, step_seconds=0.25))
    assert text.startswith("Plan, phase 0: epoch 0, global batch 16, 2 replica(s), 5 steps")
    assert "local batches per replica: (8, 8), (3, 3)\n" in text
    tagged = Plan.build(STAGES, phase(16, epochs=3), steps, 2, tag="train")
    assert str(tagged).startswith("Plan (train), phase 0: epochs 0-2,")


def test_a_pipelines_plans_show_as_their_summaries_at_a_prompt():
    """``pipe.plan(...)`` in a notebook shows its repr: the plans' summaries, not pages
    of StepSpec dataclasses."""
    import numpy as np
    import torch

    x = np.zeros((600, 1, 4, 4), dtype=np.float32)
    pipe = dfl.Pipeline(
        model=lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2)),
        loss=torch.nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        source=dfl.io.ArraySource(x, np.zeros(600, dtype=np.int64)),
        schedule=dfl.schedule.Stepwise({0: 64, 1: 128}),
        progress=False,
    )
    plans = pipe.plan(epochs=2, replicas=3)
    shown = repr(plans)
    assert "StepSpec(" not in shown and shown == str(plans)
    assert shown.startswith("Plan, phase 0: epoch 0, global batch 64, 3 replica(s)")
    assert "\nPlan, phase 1: epoch 1, global batch 128" in shown
    assert isinstance(plans, list) and len(plans) == 2
