"""Gradient accumulation under a per-replica memory cap (micro-batches)."""

import numpy as np
import pytest
import torch
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline

from dataflow.core.step import micro_batch_sizes
from dataflow.errors import ConfigError
from dataflow.runtime.replica import micro_batch_groups
from dataflow.schedule.balance import micro_batch_counts
from dataflow.stages import AllReduce, Backward, Forward, Load, Transform, Update
from dataflow.stages.base import Batch


@pytest.mark.parametrize("batch", [1, 7, 16, 33, 100])
@pytest.mark.parametrize("cap", [1, 3, 8, 64])
def test_micro_batches_respect_the_cap_and_cover_the_batch(batch, cap):
    [count] = micro_batch_counts([batch], cap)
    sizes = micro_batch_sizes(batch, count)
    assert sum(sizes) == batch
    assert max(sizes) <= cap
    assert max(sizes) - min(sizes) <= 1
    assert count == -(-batch // cap)  # no more micro-batches than the cap needs


def test_micro_batch_counts_per_replica_caps_minimum_and_no_cap():
    assert micro_batch_counts([40, 10], None) == (1, 1)
    assert micro_batch_counts([40, 10], (16, 4)) == (3, 3)
    assert micro_batch_counts([40, 1, 0], None, minimum=2) == (2, 1, 1)  # never below 1 sample
    with pytest.raises(ConfigError, match="one per replica"):
        micro_batch_counts([4, 4], (2, 2, 2))


def test_forward_and_backward_form_the_accumulation_group():
    stages = {
        "Load": Load(_Source()),
        "T": Transform(lambda x: x),
        "Forward": Forward(torch.nn.Linear(2, 2), torch.nn.functional.mse_loss),
        "Backward": Backward(),
        "AllReduce": AllReduce(),
        "Update": Update(lambda p: torch.optim.SGD(p, lr=0.1)),
    }
    groups = micro_batch_groups(tuple(stages), stages)
    assert groups == [("Load",), ("T",), ("Forward", "Backward"), ("AllReduce",), ("Update",)]


def test_batch_slice_cuts_every_input_and_the_indices():
    batch = Batch(x=(torch.arange(6), torch.arange(6) * 2), y=torch.arange(6), size=6)
    batch.indices = np.arange(10, 16)
    part = batch.slice(2, 5)
    assert part.size == 3
    assert part.x[1].tolist() == [4, 6, 8] and part.y.tolist() == [2, 3, 4]
    assert part.indices.tolist() == [12, 13, 14]


class _Source:
    num_samples = 4

    def read(self, indices):
        return Batch(x=torch.zeros(len(indices), 2), y=torch.zeros(len(indices), 2))


@pytest.mark.slow
@pytest.mark.parametrize("replicas, cap", [(2, 5), (1, 6)])
def test_accumulated_micro_batches_train_like_whole_batches(client, replicas, cap):
    x, y = make_data(96)
    pipe = tiny_pipeline(x, y, batch=32, replicas=replicas, max_micro_batch=cap)
    result = pipe.fit(epochs=2, client=client)
    local = 32 // replicas
    expected_count = -(-local // cap)
    assert result.history.phases[0]["micro_batches"] == [expected_count] * replicas
    batches = pipe.sample_plan(epochs=2, replicas=replicas)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-5
    for epoch in range(2):
        assert result.ledger.consumed(epoch).tolist() == list(range(96))
