"""The Dask task functions that drive a fit's replica on its worker.

Each looks its replica up in the worker plugin by run id; only small results
(losses, timings, states asked for) go back to the driver. Tasks of a process
group that a recovery replaced refuse to run (:func:`_current`).
"""

from __future__ import annotations

import gc
from typing import Any
from urllib.parse import urlparse

import torch

from dataflow.core.errors import ReplicaError
from dataflow.core.rng import restore_rng
from dataflow.core.window import WindowResult
from dataflow.runtime.collective import Collective, connect_store, open_store
from dataflow.runtime.malloc import needs_relaxing, relax_malloc
from dataflow.runtime.plugin import current_plugin
from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec, resolve_device
from dataflow.stages.base import PhaseContext


def worker_host() -> str:
    plugin = current_plugin()
    return urlparse(plugin.worker.address).hostname or "127.0.0.1"


def group_key(run_id: str, generation: int) -> str:
    """The name of a fit's process group: a new one each time the set of workers changes."""
    return run_id if generation == 0 else f"{run_id}/g{generation}"


def open_rendezvous(
    run_id: str, world_size: int, timeout_s: float, generation: int = 0
) -> tuple[str, int]:
    """On rank 0's worker: start the store on a free port; return where to reach it."""
    host = worker_host()
    store = open_store(host, world_size, timeout_s)
    current_plugin().stores[group_key(run_id, generation)] = store
    return host, store.port


def _join_group(
    spec: ReplicaSpec,
    rank: int,
    world_size: int,
    host: Any,
    port: Any,
    generation: int,
    device: torch.device,
) -> Collective | None:
    if world_size == 1:
        return None
    key = group_key(spec.run_id, generation)
    if rank == 0:
        store = current_plugin().stores.pop(key)
    else:
        store = connect_store(host, port, world_size, spec.collective_timeout_s)
    collective = Collective(
        store,
        rank=rank,
        world_size=world_size,
        device=device,
        host=worker_host(),
        timeout_s=spec.collective_timeout_s,
        prefix=key,
    )
    collective.store = store  # keep rank 0's server alive as long as the group
    return collective


def setup_replica(
    spec: ReplicaSpec,
    rank: int,
    world_size: int,
    host: str | None,
    port: int | None,
    generation: int = 0,
    snapshot: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Join the process group and build the replica (model, optimizer, hooks).

    A replica joining a running fit (``snapshot``: rank 0's model and optimizer state
    at the phase boundary) gets the weights by the AllReduce stage's broadcast and the
    optimizer state (momentum, step counts) from the snapshot.
    """
    plugin = current_plugin()
    # Default: the worker's own thread budget (1 per process on the default LocalCluster),
    # so replicas sharing a node do not oversubscribe its cores.
    torch.set_num_threads(spec.threads or plugin.worker.state.nthreads)
    malloc_relaxed = spec.relax_malloc and needs_relaxing() and relax_malloc()
    device = resolve_device(spec.device, rank)
    collective = _join_group(spec, rank, world_size, host, port, generation, device)
    runtime = ReplicaRuntime(spec, rank=rank, world_size=world_size, collective=collective)
    runtime.generation = generation
    if snapshot is not None:
        runtime.load_snapshot(snapshot)
    plugin.replicas[spec.run_id] = runtime
    if spec.pause_dask_profiler:
        plugin.pause_profiler(spec.run_id)
    if spec.freeze_gc:
        # A worker holds ~350k long-lived objects (torch, dask); each full collection
        # walks them all and stalls the step (or the event loop) for 100-200 ms, and the
        # other replicas wait for it in the allreduce. Move them out of the collector's view.
        gc.collect()
        gc.freeze()
    return {
        "rank": rank,
        "worker": plugin.worker.address,
        "device": str(runtime.context.device),
        "torch_threads": torch.get_num_threads(),
        "backend": None if collective is None else collective.backend,
        "malloc_relaxed": malloc_relaxed,
    }


def regroup_replica(
    run_id: str,
    world_size: int,
    host: str | None,
    port: int | None,
    generation: int,
    after: Any = None,
    rank: int | None = None,
) -> int:
    """An existing replica joins the fit's new process group, under ``rank`` (default:
    its own)."""
    runtime = current_plugin().replica(run_id)
    if rank is not None:
        runtime.context.rank = rank
    rank = runtime.context.rank
    collective = _join_group(
        runtime.spec, rank, world_size, host, port, generation, runtime.context.device
    )
    runtime.regroup(collective, world_size)
    runtime.generation = generation
    return rank


def rollback_replica(run_id: str, commit_step: int, rank: int, leave_group: bool = True) -> int:
    """Back to the commit before ``commit_step``, under ``rank``. A survivor of a lost
    worker leaves its broken group first (``regroup_replica`` then joins it to the
    survivors' new one); after a NaN the group is intact and stays."""
    runtime = current_plugin().replica(run_id)
    if leave_group:
        runtime.abort()  # the old group lost a member: leave it (idempotent)
    with runtime.lock:  # an aborted window still running here ends at its next wait
        runtime.rollback(commit_step)
        runtime.context.rank = rank
    return rank


def restore_replica(
    run_id: str,
    state: dict[str, Any],
    rng: dict[str, Any] | None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> None:
    """Resume: the checkpoint's weights, optimizer state and stage settings, and this
    rank's random state and buffers (saved mid-phase, for the same replica count)."""

    runtime = current_plugin().replica(run_id)
    runtime.load_snapshot(state)
    if buffers and runtime.context.model is not None:
        named = dict(runtime.context.model.named_buffers())
        with torch.no_grad():
            for name, value in buffers.items():
                named[name].copy_(value)
    if rng is not None:
        restore_rng(rng)


def replica_checkpoint_state(run_id: str, after: Any = None) -> dict[str, Any]:
    """This replica's part of a checkpoint (see :meth:`ReplicaRuntime.checkpoint_state`)."""
    return current_plugin().replica(run_id).checkpoint_state()


def replica_snapshot(run_id: str, after: Any = None) -> dict[str, Any]:
    """Rank 0's model and optimizer state, for replicas joining at a phase boundary."""
    return current_plugin().replica(run_id).snapshot()


def _current(run_id: str, generation: int) -> ReplicaRuntime:
    """This worker's replica of the fit, if the task belongs to its current process group.

    After a lost worker the driver drops the tasks it had queued rather than cancel
    them; one that still runs here finds a newer generation and refuses.
    """
    runtime = current_plugin().replica(run_id)
    if runtime.generation != generation:
        raise ReplicaError(
            f"stale task of process group {generation} on replica {runtime.context.rank} "
            f"(now in group {runtime.generation}); the driver recovered from a lost worker"
        )
    return runtime


def begin_phase(run_id: str, phase: PhaseContext, after: Any = None, generation: int = 0) -> int:
    _current(run_id, generation).begin_phase(phase)
    return phase.index


def run_window(
    run_id: str,
    first_step: int,
    stop_step: int,
    after: Any = None,
    generation: int = 0,
    checkpoint: bool = False,
) -> WindowResult:
    """Run steps ``[first_step, stop_step)``; ``after`` only orders it behind the last task.
    ``checkpoint``: return the state at the window's end too (a mid-phase checkpoint)."""
    return _current(run_id, generation).run_window(first_step, stop_step, checkpoint)


def end_phase(run_id: str, after: Any = None, generation: int = 0) -> dict[str, Any]:
    return _current(run_id, generation).end_phase()


def replica_state_dict(run_id: str) -> dict[str, torch.Tensor]:
    return current_plugin().replica(run_id).state_dict()


def abort_run(run_id: str, dask_worker: Any = None) -> None:
    """Via ``client.run`` (outside the task thread): break collectives of a failed fit."""
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    if plugin is not None:
        plugin.abort_run(run_id)


async def abort_run_soon(run_id: str, dask_worker: Any = None) -> None:
    """:func:`abort_run` for ``client.run(..., wait=False)`` (which takes coroutines)."""
    abort_run(run_id, dask_worker)


def close_run(run_id: str, dask_worker: Any = None) -> None:
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    if plugin is not None:
        plugin.close_run(run_id)


async def close_run_soon(run_id: str, dask_worker: Any = None) -> None:
    close_run(run_id, dask_worker)
