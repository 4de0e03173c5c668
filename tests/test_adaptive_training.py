"""The Adaptive schedule on a real LocalCluster: the engine measures the gradient noise
scale from the allreduce (or from micro-batches on one replica) and the schedule grows
the batch and the LR from it."""

import itertools
import math

import numpy as np
import pytest
import torch
from conftest import make_data, tiny_pipeline

import dataflow as dfl

pytestmark = pytest.mark.slow


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02)


@pytest.mark.parametrize("replicas", [2, 1])
def test_adaptive_grows_the_batch_from_the_measured_noise_scale(client, replicas):
    x, _ = make_data(192)
    y = np.digitize(x[:, 0, :4, :4].mean(axis=(1, 2)), [-0.1, 0.1])  # learnable: a signal
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
