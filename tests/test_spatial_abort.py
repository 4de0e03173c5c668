"""Under a spatial layout a worker waits in two process groups: the fit's (gradients)
and its sample group's (a layer's halos, the model's shape and BatchNorm allreduces).
When the driver stops a window (a worker lost), it aborts the run on the survivors and
on the lost worker's partners: both waits must end at once. The sample group's did
not, and a partner blocked in a layer's allreduce held the recovery for the whole
collective timeout (20 s in the fault soak, kill: step 1, rank 0, +0.16 s, spatial).

Two ranks of real gloo groups in this process; rank 1 never enters the collective, as
a partner that died would not."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from conftest import gloo_pair

from dataflow import stages
from dataflow.core.errors import CollectiveError
from dataflow.graph import Graph
from dataflow.io import ArraySource
from dataflow.planning.layout import Layout
from dataflow.runtime.collective import Collective
from dataflow.runtime.replica import ReplicaRuntime
from dataflow.runtime.replica_spec import ReplicaSpec
from dataflow.runtime.spatial_rank import spatial_rank


def _runtime(world: Collective, sample_group: Collective) -> ReplicaRuntime:
    g = Graph()
    g.add(stages.Load(ArraySource(torch.zeros(4, 1, 8, 8).numpy(), torch.zeros(4).long().numpy())))
    spec = ReplicaSpec(run_id="abort", graph=g, order=g.validate(replicas=1), seed=0, device="cpu")
    layout = Layout(spatial=2)
    spatial = spatial_rank(layout, 0, sample_group, seed=0)
    return ReplicaRuntime(spec, rank=0, world_size=1, collective=world, spatial=spatial)


@pytest.mark.timeout(120)
def test_an_abort_ends_a_wait_in_the_sample_groups_collective_at_once():
    store = dist.HashStore()
    world, _ = gloo_pair(store, "fit/g0")
    sample_group, _partner = gloo_pair(store, "fit/g0/sample-group0")
    runtime = _runtime(world, sample_group)
    errors: list[BaseException] = []

    def layer_allreduce() -> None:  # what SpatialModule's shape allreduce does
        try:
            runtime.context.spatial.group.allreduce_(torch.ones(3))
        except BaseException as error:
            errors.append(error)

    waiting = threading.Thread(target=layer_allreduce, daemon=True)
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive(), "the partner never entered the allreduce: it waits"
    runtime.abort()  # the driver's abort_run_soon on this worker
    waiting.join(timeout=30)
    assert not waiting.is_alive(), "the wait went on after the abort"
    [error] = errors
    assert isinstance(error, CollectiveError) and "aborted while waiting" in str(error)
    assert world.closed and sample_group.closed
