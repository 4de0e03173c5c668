"""What the driver asks a fit's replica on its worker: typed requests, one task
function.

Every request (set up, regroup, roll back, restore, capture a state, begin a phase,
run a window, end the phase) is a small dataclass, and :func:`handle` runs each one
after checking it against the replica's process-group generation: a task of a group
that a recovery replaced refuses to run. Only small results (losses, timings, the
states asked for) go back to the driver.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlparse

import torch

from dataflow.core.errors import CollectiveError, ReplicaError
from dataflow.core.precision import StepOptions
from dataflow.core.window import WindowResult
from dataflow.runtime.collective import (
    Collective,
    aborted_message,
    await_arrivals,
    connect_store,
    open_store,
)
from dataflow.runtime.malloc import needs_relaxing, relax_malloc
from dataflow.runtime.plugin import current_plugin, plugin_of
from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec, resolve_device
from dataflow.runtime.spatial_rank import spatial_rank
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
    plugin = current_plugin()

    def aborted() -> bool:
        return key in plugin.aborted_groups

    if aborted():  # a stale task: the driver gave this group up before it ran here
        plugin.stores.pop(key, None)
        raise CollectiveError(aborted_message(rank, key))
    if rank == 0:
        store = plugin.stores.pop(key)
    else:
        store = connect_store(
            host, port, world_size, spec.collective_timeout_s, aborted=aborted, prefix=key
        )
    await_arrivals(
        store,
        rank=rank,
        world_size=world_size,
        timeout_s=spec.collective_timeout_s,
        aborted=aborted,
        prefix=key,
    )
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
    plugin.forming_groups[key] = collective  # until the setup or regroup ends
    if key in plugin.aborted_groups:  # given up while this rank arrived
        collective.abort()
    return collective


def _join_spatial(spec: ReplicaSpec, world: Collective, rank: int, generation: int) -> Collective:
    """The process group of ``rank``'s sample group (``spec.spatial`` consecutive ranks),
    formed at the fit's store under its own prefix."""
    size = spec.spatial
    return Collective(
        world.store,
        rank=rank % size,
        world_size=size,
        device=world.device,
        host=worker_host(),
        timeout_s=spec.collective_timeout_s,
        prefix=f"{group_key(spec.run_id, generation)}/sample-group{rank // size}",
    )


@dataclass(frozen=True)
class Request:
    """A task the driver sends a replica: typed, and checked in one place
    (:func:`handle`) against the replica's process-group ``generation``. A request of
    an older group than the replica's is stale (the driver recovered meanwhile and
    dropped it) and refused; ``exact`` requests (steps, phases, states) also need the
    replica to be in that very group."""

    run_id: str
    generation: int
    exact: ClassVar[bool] = True

    def run(self, runtime: ReplicaRuntime) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Setup(Request):
    """Join group ``generation`` as ``rank`` of ``world_size`` and build the replica
    (model, optimizer, hooks); a joiner takes rank 0's ``snapshot`` (its weights then
    arrive by the AllReduce stage's broadcast)."""

    rank: int = 0
    world_size: int = 1
    host: str | None = None
    port: int | None = None
    exact: ClassVar[bool] = False


@dataclass(frozen=True)
class Regroup(Request):
    """A replica that keeps its state joins the new group ``generation`` as ``rank``."""

    rank: int = 0
    world_size: int = 1
    host: str | None = None
    port: int | None = None
    exact: ClassVar[bool] = False

    def run(self, runtime: ReplicaRuntime) -> int:
        size = runtime.spec.spatial
        runtime.context.rank, runtime.slot = self.rank // size, self.rank
        collective = _join_group(
            runtime.spec,
            self.rank,
            self.world_size,
            self.host,
            self.port,
            self.generation,
            runtime.context.device,
        )
        if runtime.context.spatial is not None:
            old = runtime.context.spatial.rejoin(
                _join_spatial(runtime.spec, collective, self.rank, self.generation)
            )
            if old is not None:  # kept alive: see Collective.abort
                runtime.retired.append(old)
        runtime.regroup(collective, self.world_size // size)
        runtime.generation, runtime.rollbacks = self.generation, 0
        plugin = current_plugin()
        plugin.forming_groups.pop(group_key(runtime.spec.run_id, self.generation), None)
        runtime.attach_store(plugin.worker, plugin.ps)
        return self.rank


@dataclass(frozen=True)
class RollBack(Request):
    """Back to the commit before ``step``, under ``rank``. A survivor of a lost worker
    leaves its broken group first; after a NaN the group is intact and stays."""

    step: int = 0
    rank: int = 0
    leave_group: bool = True
    exact: ClassVar[bool] = False  # it may still be in the group a failed regroup left

    def run(self, runtime: ReplicaRuntime) -> int:
        if self.leave_group:
            runtime.abort()  # the old group lost a member: leave it (idempotent)
        with runtime.lock:  # an aborted window still running here ends at its next wait
            runtime.rollback(self.step)
            runtime.context.rank = self.rank // runtime.spec.spatial
            runtime.slot = self.rank
        if runtime.context.device.type == "cuda":  # what a failed window (out of memory) held
            gc.collect()
            torch.cuda.empty_cache()
        return self.rank


@dataclass(frozen=True)
class Restore(Request):
    """Take a checkpoint's state (weights, optimizer, stage settings; this rank's random
    state and buffers when it was saved on as many replicas)."""

    state: Any = None  # ReplicaState

    def run(self, runtime: ReplicaRuntime) -> None:
        runtime.restore(self.state)


@dataclass(frozen=True)
class Capture(Request):
    """This replica's state: ``"checkpoint"`` (its part of a checkpoint), ``"snapshot"``
    (what a joiner takes from rank 0), ``"weights"`` (the final weights) or
    ``"averaged"`` (the final weights' moving average, ``ema_decay``)."""

    what: str = "checkpoint"
    # Sent with the newest group the driver formed or tried to: a replica that a failed
    # regroup left in an older one still answers (its state is the commit either way).
    exact: ClassVar[bool] = False

    def run(self, runtime: ReplicaRuntime) -> Any:
        if self.what == "weights":
            return runtime.state_dict()
        if self.what == "averaged":
            return runtime.averaged_state_dict()
        return runtime.snapshot() if self.what == "snapshot" else runtime.checkpoint_state()


@dataclass(frozen=True)
class BeginPhase(Request):
    phase: PhaseContext | None = None

    def run(self, runtime: ReplicaRuntime) -> int:
        runtime.begin_phase(self.phase)
        return self.phase.index


@dataclass(frozen=True)
class RunWindow(Request):
    """Steps ``[first_step, stop_step)``; ``checkpoint``: the state at the window's end
    comes back with the result (a mid-phase checkpoint); ``weights``: the weights and
    buffers only (the epoch's end, for ``keep_best``)."""

    first_step: int = 0
    stop_step: int = 0
    checkpoint: bool = False
    weights: bool = False

    def run(self, runtime: ReplicaRuntime) -> WindowResult | None:
        if runtime.held == self.generation:  # a stop: no window starts from now on
            raise WindowHeld(f"window [{self.first_step}, {self.stop_step}) not started")
        if runtime.released_after is not None:
            generation, stop = runtime.released_after
            if generation == self.generation and self.first_step >= stop:
                return None  # after the window in flight of a release: the driver regroups
        return runtime.run_window(
            self.first_step, self.stop_step, self.checkpoint, weights=self.weights
        )


@dataclass(frozen=True)
class EndPhase(Request):
    def run(self, runtime: ReplicaRuntime) -> dict[str, Any]:
        return runtime.end_phase()


def handle(request: Request, after: Any = None, snapshot: Any = None, spec: Any = None) -> Any:
    """The one task function: ``after`` only orders the task behind the replica's last
    one. For :class:`Setup`: ``spec`` the ReplicaSpec and ``snapshot`` rank 0's state for
    a joiner (passed beside the request, so Dask resolves them when they are futures)."""
    plugin = current_plugin()
    runtime = plugin.replicas.get(request.run_id)
    if runtime is not None:
        stale = runtime.generation > request.generation
        if stale or (request.exact and runtime.generation != request.generation):
            raise ReplicaError(
                f"{'stale ' if stale else ''}{type(request).__name__} of process group "
                f"{request.generation} on replica {runtime.context.rank} (in group "
                f"{runtime.generation}); the driver recovered from a lost worker"
            )
    if isinstance(request, Setup):
        return _setup(request, spec, snapshot)
    if runtime is None:
        plugin.replica(request.run_id)  # raises, naming the fits the worker holds
    return request.run(runtime)


def _setup(request: Setup, spec: ReplicaSpec, snapshot: Any) -> dict[str, Any]:
    plugin, rank = current_plugin(), request.rank
    spec = spec.private()  # the worker's copy of the scattered spec stays as sent
    # Default: the worker's own thread budget (1 per process on the default LocalCluster),
    # so replicas sharing a node do not oversubscribe its cores.
    torch.set_num_threads(spec.threads or plugin.worker.state.nthreads)
    malloc_relaxed = spec.relax_malloc and needs_relaxing() and relax_malloc()
    device = resolve_device(spec.device, rank)
    collective = _join_group(
        spec, rank, request.world_size, request.host, request.port, request.generation, device
    )
    spatial, size = None, spec.spatial
    if size > 1:  # this worker holds a region of each sample of replica rank // size
        group = _join_spatial(spec, collective, rank, request.generation)
        spatial = spatial_rank(spec.layout, rank % size, group, seed=spec.seed + rank // size)
    runtime = ReplicaRuntime(
        spec,
        rank=rank // size,
        world_size=request.world_size // size,
        collective=collective,
        spatial=spatial,
        device_rank=rank,
    )
    runtime.generation = request.generation
    runtime.attach_store(plugin.worker, plugin.ps)
    if snapshot is not None:
        runtime.restore(snapshot)
    plugin.replicas[spec.run_id] = runtime
    plugin.forming_groups.pop(group_key(spec.run_id, request.generation), None)
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
        # what the step computes in: precision, memory format, compile mode
        **(runtime.context.step_options or StepOptions()).describe(),
        "data_on_device": bool(runtime.context.state.get("data_on_device")),
        "torch_threads": torch.get_num_threads(),
        "backend": None if collective is None else collective.backend,
        "shared_gpu": collective is not None and collective.shared_gpu,
        "malloc_relaxed": malloc_relaxed,
    }


def abort_run(run_id: str, dask_worker: Any = None) -> None:
    """Via ``client.run`` (outside the task thread): break collectives of a failed fit."""
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    if plugin is not None:
        plugin.abort_run(run_id)


async def abort_group_soon(run_id: str, generation: int, dask_worker: Any = None) -> None:
    """Via ``client.run(..., wait=False)``: give up forming the fit's process group of
    ``generation`` here (a member was lost while it formed; the driver forms another)."""
    if dask_worker is not None:  # installed if missing: the Setup may not have run yet
        plugin = plugin_of(dask_worker)
        key = group_key(run_id, generation)
        plugin.aborted_groups.add(key)
        # joined already, its stages' setup waiting on the lost member: abort it (kept
        # alive: destroying a group that waits on a dead peer freezes the worker)
        forming = plugin.forming_groups.pop(key, None)
        if forming is not None:
            forming.abort()
            plugin.retired_groups.append(forming)


async def abort_run_soon(run_id: str, generation: int, dask_worker: Any = None) -> None:
    """:func:`abort_run` for ``client.run(..., wait=False)`` (which takes coroutines), for
    the process group of ``generation`` only: the driver does not wait for it to arrive,
    so it may come after this replica joined a newer group, which it must not break."""
    runtime = _runtime_of(run_id, dask_worker)
    if runtime is not None and runtime.generation <= generation:
        runtime.abort()


def _runtime_of(run_id: str, dask_worker: Any) -> Any:
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    return None if plugin is None else plugin.replicas.get(run_id)


class WindowHeld(RuntimeError):
    """A window the driver's stop kept from starting (never reported: the fit stops)."""


async def hold_run(run_id: str, generation: int, dask_worker: Any = None) -> bool:
    """Via the driver (a stop signal): this replica starts no window of ``generation``
    from now on; the one running goes on. No replica then gets more than one window past
    what the driver saw finished, so the commit it rolls back to is one each holds."""
    runtime = _runtime_of(run_id, dask_worker)
    if runtime is not None and runtime.generation == generation:
        runtime.held = generation
    return True


async def release_replicas(
    run_id: str, generation: int, lost: list[int], stop_step: int, dask_worker: Any = None
) -> None:
    """Via ``client.run`` on every survivor (asynchronous updates): replicas ``lost``
    are gone. The parameter-store shards hosted here stop waiting for them; the window
    in flight finishes without them (its lost parts retrained) and no later window of
    this group runs: the driver regroups the survivors from there."""
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    runtime = None if plugin is None else plugin.replicas.get(run_id)
    if runtime is None or runtime.generation != generation:
        return
    runtime.released_after = (generation, stop_step)
    await plugin.ps.store.run(plugin.ps.drop(f"{run_id}/g{generation}", lost))


def close_run(run_id: str, dask_worker: Any = None) -> None:
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    if plugin is not None:
        plugin.close_run(run_id)


async def close_run_soon(run_id: str, generation: int, dask_worker: Any = None) -> None:
    """:func:`close_run` for a joiner whose group ``generation`` failed to form; not
    when it already joined a newer group (the driver does not wait for this to arrive)."""
    runtime = _runtime_of(run_id, dask_worker)
    if runtime is None or runtime.generation <= generation:
        close_run(run_id, dask_worker)
