"""Phases on a real LocalCluster: a growing batch with its LR, and rebalancing a slow node."""

import numpy as np
import pytest
import torch
from conftest import (
    assert_the_balancer_followed_the_throttle,
    make_data,
    max_abs_diff,
    reference_training,
    tiny_pipeline,
)

import dataflow as dfl
from dataflow.schedule import lr_at

pytestmark = pytest.mark.slow


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def test_stepwise_grows_batch_and_lr_and_matches_a_single_process(client):
    x, y = make_data(96)
    schedule = dfl.schedule.Stepwise({0: 8, 1: 16, 2: 32}, lr_scaling="linear", warmup_steps=2)
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule)
    result = pipe.fit(epochs=3, client=client)
    phases = result.history.phases
    assert [(p["start_epoch"], p["global_batch"]) for p in phases] == [(0, 8), (1, 16), (2, 32)]
    assert [p["lr"] for p in phases] == pytest.approx([0.02, 0.04, 0.08])
    losses = [e["train_loss"] for e in result.history.epochs]
    assert losses[-1] < losses[0]
    # The single-process reference on the same batches, with the same LR per step.
    batches = pipe.sample_plan(epochs=3, replicas=2)
    lrs, previous = [], 0.02
    for batch, steps in ((8, 12), (16, 6), (32, 3)):
        target = 0.02 * batch / 8
        lrs += [lr_at(previous, target, k, 0 if batch == 8 else 2) for k in range(steps)]
        previous = target
    assert len(lrs) == len(batches)
    expected = reference_training(x, y, batches=batches, seed=0, optimizer=plain_sgd, lrs=lrs)
    assert max_abs_diff(result.model, expected) <= 1e-5
    for epoch in range(3):  # still every sample once per epoch
        assert result.ledger.consumed(epoch).tolist() == list(range(96))


class ConvNet(torch.nn.Module):
    """Enough compute per sample that a step's time is mostly compute."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def test_a_throttled_replica_gets_the_share_its_measured_speed_gives(client):
    """Replica 1 throttled 2x under ``Throughput``: each phase after the first is split
    from the speeds measured before it, the throttle's pause counted in replica 1's, and
    trained as split. The decisions are checked, not the speeds (a shared 2-core machine
    moves those); that the rebalanced fit is faster is ``bench_heterogeneous.py``'s
    measurement."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(768, 1, 24, 24)).astype(np.float32)
    y = rng.integers(0, 3, size=768)
    pipe = tiny_pipeline(
        x,
        y,
        model=ConvNet,
        optimizer=plain_sgd,
        schedule=dfl.schedule.Fixed(96, epochs_per_phase=1),
        balancer=dfl.balance.Throughput(smoothing=1.0),
        throttle={1: 2.0},
    )
    result = pipe.fit(epochs=3, client=client)
    phases = result.history.phases
    print("\nthrottle 2x: split", [p["local_batches"] for p in phases])
    assert phases[0]["local_batches"] == [48, 48]
    assert_the_balancer_followed_the_throttle(phases, slow=1, factor=2.0)
    for phase in phases:  # each phase trained as split: its samples, replica by replica
        steps = phase["steps"]
        assert phase["samples_trained"] == [b * steps for b in phase["local_batches"]]
    for epoch in range(3):
        assert result.ledger.consumed(epoch).tolist() == list(range(768))
