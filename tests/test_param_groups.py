"""An optimizer with param groups (per-group LRs, weight decay only on weights): every
group keeps its LR, and its ratio to the others, under each schedule's LR rules."""

import pytest
import torch
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline

import dataflow as dfl
from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec
from dataflow.stages.base import PhaseContext


def grouped(params):
    """Weights at 0.05 with weight decay; biases at a fifth of it, without."""
    params = list(params)
    weights = [p for p in params if p.ndim > 1]
    biases = [p for p in params if p.ndim <= 1]
    return torch.optim.SGD(
        [{"params": weights, "weight_decay": 1e-2}, {"params": biases, "lr": 0.01}],
        lr=0.05,
        momentum=0.9,
    )


def group_lrs_per_phase(schedule) -> list[list[float]]:
    """Each phase's LR per param group, after its first step, on one in-process replica
    given the phases as the driver gives them."""
    x, y = make_data(64)
    trainer = tiny_pipeline(x, y, optimizer=grouped, schedule=schedule).trainer
    order = trainer.graph.validate(replicas=1)
    spec = ReplicaSpec(run_id="test", graph=trainer.graph, order=order, seed=0, device="cpu")
    runtime = ReplicaRuntime(spec, rank=0, world_size=1, collective=None)
    seen = []
    try:
        for plan in trainer.plan(2, 1):
            p = plan.phase
            runtime.begin_phase(
                PhaseContext(index=p.index, steps=plan.steps, lr=p.lr, lr_scale=p.lr_scale)
            )
            first = plan.steps[0].index
            runtime.run_window(first, first + 1)
            seen.append([group["lr"] for group in runtime.context.optimizer.param_groups])
            runtime.end_phase()
    finally:
        runtime.close()
    return seen


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (dfl.schedule.Fixed(16), [[0.05, 0.01]]),
        (dfl.schedule.Fixed(16, lr=0.1), [[0.1, 0.02]]),
        (dfl.schedule.Stepwise({0: 16, 1: 32}, lr_scaling="linear"), [[0.05, 0.01], [0.1, 0.02]]),
        (
            dfl.schedule.Stepwise({0: 16, 1: 32}, lr_scaling="linear", lr=0.2),
            [[0.2, 0.04], [0.4, 0.08]],
        ),
    ],
    ids=["factory", "fixed-lr", "stepwise-linear", "stepwise-lr"],
)
def test_each_param_group_keeps_its_ratio_to_the_first(schedule, expected):
    """A schedule's ``lr=`` is the first group's LR: the biases stay at a fifth of it
    (they were all set to it before), and the linear scaling of a doubled batch doubles
    both."""
    assert group_lrs_per_phase(schedule) == [pytest.approx(lrs) for lrs in expected]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync",
    [None, dfl.sync.Local(period_steps=2), dfl.sync.Async(staleness=0)],
    ids=["sync", "local", "async"],
)
def test_a_grouped_optimizer_trains_under_each_sync_policy(client, sync):
    """Two replicas with the grouped optimizer: synchronous updates equal the one-process
    loop with it; local and asynchronous ones (the parameter store builds the same
    groups over its shards) train without error, every step at the groups' LRs."""
    x, y = make_data(96)
    options = {} if sync is None else {"sync": sync}
    result = tiny_pipeline(x, y, optimizer=grouped, **options).fit(epochs=2, client=client)
    assert {step["lr"] for step in result.history.steps} == {0.05}
    assert len(result.history.steps) == 12
    if sync is None:
        batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=2)
        expected = reference_training(x, y, batches=batches, seed=0, optimizer=grouped)
        assert max_abs_diff(result.model, expected) <= 1e-5
