"""Workers joining between phases, and asking the cluster for them as the batch grows."""

import pytest
import torch
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline
from distributed import Client, LocalCluster

import dataflow as dfl
from dataflow.errors import ConfigError

pytestmark = pytest.mark.slow


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def test_scale_with_batch_grows_the_cluster_and_keeps_training_exact():
    x, y = make_data(96)
    schedule = dfl.schedule.Stepwise({0: 16, 1: 64}, lr_scaling="linear")
    pipe = tiny_pipeline(
        x,
        y,
        optimizer=plain_sgd,
        schedule=schedule,
        max_micro_batch=32,
        scale_with_batch=True,
        max_workers=2,
    )
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        result = pipe.fit(epochs=3, client=client)
        assert len(client.scheduler_info()["workers"]) == 2
    phases = result.history.phases
    assert [p["replicas"] for p in phases] == [1, 2]
    assert [p["local_batches"] for p in phases] == [[16], [32, 32]]
    assert result.history.info["regroups"][0]["phase"] == 1
    assert result.history.info["scaling"][0]["requested"] == 2
    for epoch in range(3):  # every sample once per epoch, before and after the join
        assert result.ledger.consumed(epoch).tolist() == list(range(96))
    assert result.ledger.replicas(2) == [0, 1]
    # The joined replica got the weights and the momentum: the fit equals one process.
    batches = pipe.sample_plan(epochs=3, replicas=[1, 2])
    lrs = [0.02] * 6 + [0.08] * 4
    expected = reference_training(x, y, batches=batches, seed=0, optimizer=plain_sgd, lrs=lrs)
    assert max_abs_diff(result.model, expected) <= 1e-5


def test_scale_with_batch_needs_a_cap_and_a_maximum():
    x, y = make_data(16)
    with pytest.raises(ConfigError, match="max_micro_batch"):
        tiny_pipeline(x, y, scale_with_batch=True, max_workers=4)
    with pytest.raises(ConfigError, match="max_workers"):
        tiny_pipeline(x, y, scale_with_batch=True, max_micro_batch=8)
    with pytest.raises(ConfigError, match="replicas=None"):
        tiny_pipeline(x, y, scale_with_batch=True, max_micro_batch=8, max_workers=2, replicas=1)
