"""The Adaptive schedule on a real LocalCluster: the engine measures the gradient noise
scale from the allreduce (or from micro-batches on one replica) and the schedule grows
the batch and the LR from it."""

import itertools
import math

import numpy as np
import pytest
import torch
from conftest import make_data, max_abs_diff, tiny_pipeline

import dataflow as dfl

pytestmark = pytest.mark.slow


def learnable_data(n: int = 192) -> tuple[np.ndarray, np.ndarray]:
    """make_data's inputs with labels that follow a signal in them (so |G|^2 is real)."""
    x, _ = make_data(n)
    return x, np.digitize(x[:, 0, :4, :4].mean(axis=(1, 2)), [-0.1, 0.1])


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02)


@pytest.mark.parametrize("replicas", [2, 1])
def test_adaptive_grows_the_batch_from_the_measured_noise_scale(client, replicas):
    x, y = learnable_data()
    schedule = dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0)
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule, replicas=replicas)
    result = pipe.fit(epochs=4, client=client)
    phases = result.history.phases
    assert len(phases) == 4
    if replicas == 1:  # one replica measures from two micro-batches per step
        assert all(p["micro_batches"] == [2] for p in phases)
    for before, after in itertools.pairwise(phases):
        measured = before["measured_noise_scale"]
        # None while the estimate of |G|^2 is not positive yet (noise dominates)
        assert measured is None or (math.isfinite(measured) and measured > 0)
        # each phase is chosen from the estimate measured up to the phase before
        assert after["noise_scale"] == (None if measured is None else pytest.approx(measured))
        assert after["global_batch"] == schedule.next_batch(before["global_batch"], measured)
        assert after["gain"] == pytest.approx(
            schedule.lr_scale(after["global_batch"], measured, before["gain"] or 1.0)
        )
        assert after["lr"] == pytest.approx(0.02 * after["gain"])
    assert phases[-1]["measured_noise_scale"] is not None
    assert phases[-1]["global_batch"] > phases[0]["global_batch"]
    for epoch in range(4):
        assert result.ledger.consumed(epoch).tolist() == list(range(192))


def test_adaptive_under_local_updates_measures_as_synchronous_training(client):
    """Local and asynchronous updates measure the noise scale once per window, from the
    replicas' first gradients (all on the window's starting weights), allreduced once.
    With one step per window that is every step, on the same weights as synchronous
    training: the same estimates, the same batches, the same model."""
    x, y = learnable_data()
    schedule = dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0)
    options = dict(optimizer=plain_sgd, schedule=schedule, replicas=2)
    local = tiny_pipeline(x, y, sync=dfl.sync.Local(period_steps=1), **options)
    synchronous = tiny_pipeline(x, y, window_steps=1, **options)
    got = local.fit(epochs=4, client=client)
    expected = synchronous.fit(epochs=4, client=client)
    mine, theirs = got.history.phases, expected.history.phases
    assert [p["global_batch"] for p in mine] == [p["global_batch"] for p in theirs]
    assert mine[-1]["global_batch"] > mine[0]["global_batch"]
    for a, b in zip(mine, theirs, strict=True):
        if b["measured_noise_scale"] is None:
            assert a["measured_noise_scale"] is None
        else:
            assert a["measured_noise_scale"] == pytest.approx(b["measured_noise_scale"], rel=1e-4)
    assert max_abs_diff(got.model, expected.model) <= 1e-5


def test_adaptive_grows_the_batch_under_asynchronous_updates(client):
    x, y = learnable_data()
    # one measurement per window: short windows, and trust an estimate from 3 of them
    schedule = dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0, min_measured_steps=3)
    sync = dfl.sync.Async(staleness=1)
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule, sync=sync, window_steps=3)
    result = pipe.fit(epochs=4, client=client)
    phases = result.history.phases
    measured = [p["measured_noise_scale"] for p in phases]
    # (4 windows a phase are few: a phase's estimate of |G|^2 may not be positive yet)
    assert measured[0] is not None and all(m is None or m > 0 for m in measured)
    assert phases[-1]["global_batch"] > phases[0]["global_batch"]
    for epoch in range(4):
        assert result.ledger.consumed(epoch).tolist() == list(range(192))
