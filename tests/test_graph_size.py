"""An in-memory source goes to the workers once, scattered, never inside a task graph.

Dask warns "Sending large graph of size ..." (a UserWarning on the client, from the
thread that submits) when a graph it sends carries more than
``distributed.admin.large-graph-warning-threshold`` (10 MB): the replica spec, whose
graph holds the ``ArraySource``, once travelled inside the Setup task of every worker
joining a fit (``scale_with_batch``, a nanny's restart after a loss). Each test trains
on a 64 MiB source and records that warning (every other warning stays an error).

Real LocalClusters with nannies; a worker really killed (tests/test_lost_worker.py).
The spec stays on the workers for the whole fit, so each Setup works on its own copy
of it (sharing the source's arrays): the one a worker holds must stay as sent.
"""

from __future__ import annotations

import types
import warnings
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import TinyCNN, sgd
from distributed import Client, LocalCluster
from test_lost_worker import KillOnce, WaitForWorkers

import dataflow as dfl
from dataflow import stages
from dataflow.runtime.replica_spec import ReplicaSpec

SAMPLES = 1024  # of 1 x 128 x 128 float32: 64 MiB


def big_source() -> dfl.io.ArraySource:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 1, 128, 128), dtype=np.float32)
    y = rng.integers(0, 3, size=SAMPLES).astype(np.int64)
    assert x.nbytes == 64 * 2**20
    return dfl.io.ArraySource(x, y)


def pooled_cnn() -> torch.nn.Module:
    """TinyCNN on each sample pooled to 8 x 8: the steps stay cheap, the data is big."""
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(8), TinyCNN())


@contextmanager
def large_graphs():
    """The "Sending large graph" warnings sent meanwhile (a list, filled on exit)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")  # as pytest's filterwarnings=error
        warnings.filterwarnings("always", message="Sending large graph")
        found: list[str] = []
        yield found
    found += [str(w.message).splitlines()[0] for w in caught]


def assert_every_sample_once(result, epochs: int) -> None:
    for epoch in range(epochs):
        assert result.ledger.consumed(epoch).tolist() == list(range(SAMPLES)), epoch


def test_a_replicas_own_spec_shares_the_sources_arrays_and_nothing_else():
    """What a Setup changes (Load's source, made a spatial rank's region) is its own;
    the source's arrays are the same objects (no copy of the data per Setup)."""
    source = dfl.io.ArraySource(np.zeros((8, 1, 4, 4), np.float32), np.zeros(8, np.int64))
    held_out = dfl.io.ArraySource(np.ones((4, 1, 4, 4), np.float32), shuffle=False)
    g = dfl.Graph()
    out = g.add(
        stages.Forward(pooled_cnn, torch.nn.functional.cross_entropy), g.add(stages.Load(source))
    )
    g.add(stages.Evaluate(held_out, metrics={"loss": torch.nn.functional.cross_entropy}), out)
    spec = ReplicaSpec(run_id="r", graph=g, order=tuple(s.name for s in g), seed=0)
    own = spec.private()
    [load, load_own] = [next(s for s in x.graph if isinstance(s, stages.Load)) for x in (spec, own)]
    assert load_own is not load and load_own.source is not load.source
    assert load_own.source.x is source.x and load_own.source.y is source.y
    evaluate = next(s for s in own.graph if isinstance(s, stages.Evaluate))
    assert evaluate.source.x is held_out.x
    load_own.source = load_own.source.region({1: (0, 2)})  # as a spatial rank's setup does
    assert load.source is source and source.region_shape == (1, 4, 4)


@pytest.mark.slow
def test_a_worker_joining_with_scale_with_batch_gets_the_source_outside_the_graph():
    pipe = dfl.Pipeline(
        model=pooled_cnn,
        device="cpu",
        loss=torch.nn.functional.cross_entropy,
        optimizer=sgd,
        source=big_source(),
        schedule=dfl.schedule.Stepwise({0: 128, 1: 512}, lr_scaling="none"),
        max_micro_batch=256,
        scale_with_batch=True,
        max_workers=2,
        progress=False,
    )
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
        large_graphs() as sent,
    ):
        result = pipe.fit(epochs=2, client=client)
    assert sent == []
    assert [p["replicas"] for p in result.history.phases] == [1, 2]  # the worker joined
    assert result.history.info["regroups"][0]["phase"] == 1
    assert_every_sample_once(result, 2)


@pytest.mark.slow
def test_a_recovery_after_a_killed_worker_gets_the_source_outside_the_graph(tmp_path):
    """Replica 1's worker is SIGKILLed in phase 0; the survivor goes on, and the nanny's
    restart joins (at once, or at phase 1): its Setup fetches the scattered spec."""
    g = dfl.Graph()
    batch = g.add(stages.Load(big_source()))
    batch = g.add(KillOnce(str(tmp_path / "killed"), step=3, rank=1), batch)
    batch = g.add(WaitForWorkers(step=7, count=2), batch)  # phase 0's last step
    out = g.add(stages.Forward(pooled_cnn, torch.nn.functional.cross_entropy), batch)
    reduced = g.add(stages.AllReduce(), g.add(stages.Backward(), out))
    g.add(stages.Update(sgd), reduced)
    trainer = dfl.Trainer(
        g,
        schedule=dfl.schedule.Stepwise({0: 128, 1: 256}, lr_scaling="none"),
        seed=0,
        progress=False,
        window_seconds=0.3,
        collective_timeout_s=20.0,
    )
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
        large_graphs() as sent,
    ):
        result = trainer.fit(epochs=2, client=client)
    assert sent == []
    assert (tmp_path / "killed").exists()
    [failure] = result.history.info["failures"]
    assert failure["reason"] == "lost workers" and failure["phase"] == 0
    assert result.history.phases[-1]["replicas"] == 2  # the restarted worker joined
    assert_every_sample_once(result, 2)


def test_a_spec_held_only_outside_the_new_group_is_sent_again_to_a_member():
    """The spec counts as on the cluster only where a member of the group forming holds
    it: a worker excluded as hung (alive, outside the group) may die as the new group's
    setups fetch from it, and that cancels them without a member lost to recover from
    (CI met it: a hung spatial partner killed as the next group formed)."""
    from dataflow.driver.group_forming import GroupForming

    with (
        LocalCluster(n_workers=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        first, second = sorted(cluster.scheduler.workers)
        forming = GroupForming()
        forming.client = client
        forming.spec = types.SimpleNamespace(graph="the spec", collective_timeout_s=30.0)
        forming.unreachable = set()
        [forming.spec_future] = client.scatter([forming.spec], workers=[first], hash=False)
        forming.members = (first, second)
        assert forming._spec_held()
        forming.members = (second,)  # the holder is no member of the new group
        assert not forming._spec_held()
        forming.members, forming.unreachable = (first, second), {first}  # excluded
        assert not forming._spec_held()
        forming.members, forming.unreachable = (second,), set()
        forming.scatter_spec()  # sent again, to the member
        assert list(client.who_has([forming.spec_future])[forming.spec_future.key]) == [second]
        assert forming._spec_held()
