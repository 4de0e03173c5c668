"""One replica on its worker, and the Dask task functions that drive it.

Inside a window task the stages run as a local pipeline, step after step: no Dask
round trip between steps. Each task function looks its replica up in the worker
plugin by run id; only small results (losses, timings) go back to the driver.
"""

from __future__ import annotations

import gc
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch

from dataflow.graph import Graph
from dataflow.runtime.collective import Collective, connect_store, open_store
from dataflow.runtime.malloc import needs_relaxing, relax_malloc
from dataflow.runtime.plugin import current_plugin
from dataflow.stages.base import PhaseContext, ReplicaContext, StepContext


def is_waiting(stage: Any) -> bool:
    """Stages whose time is waiting on data or peers, not this replica's compute."""
    from dataflow.stages import AllReduce, Load

    return isinstance(stage, Load | AllReduce)


THROTTLE = "throttle"  # the stage_seconds key of a simulated slow node's extra time


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a worker needs to build its replica; sent once per fit."""

    run_id: str
    graph: Graph
    order: tuple[str, ...]
    seed: int
    device: str = "auto"
    threads: int | None = None
    collective_timeout_s: float = 300.0
    relax_malloc: bool = True
    freeze_gc: bool = True
    pause_dask_profiler: bool = True
    throttle: dict[int, float] = field(default_factory=dict)  # rank -> slow-down factor


@dataclass
class WindowResult:
    """Per-step losses and timings of one window on one replica."""

    rank: int
    first_step: int
    samples: list[int]
    losses: list[float | None]
    step_seconds: list[float]
    stage_seconds: dict[str, float]
    task_seconds: float
    evals: dict[int, dict[str, float]] = field(default_factory=dict)


def resolve_device(requested: str, rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda" and device.index is None:
        # dask-cuda gives each worker one visible GPU; otherwise spread ranks over GPUs.
        device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class ReplicaRuntime:
    """A replica's stages and context; runs windows of steps."""

    def __init__(
        self, spec: ReplicaSpec, *, rank: int, world_size: int, collective: Collective | None
    ):
        self.spec = spec
        # A simulated slow node (tests, benchmarks, demos): each step sleeps
        # (throttle - 1) x its compute, i.e. the stages that do not wait on data or peers.
        self.throttle = spec.throttle.get(rank, 1.0)
        self.waiting = {name for name in spec.order if is_waiting(spec.graph[name])}
        self.order = spec.order
        self.stages = {name: spec.graph[name] for name in spec.order}
        self.inputs = {name: spec.graph.inputs_of(name) for name in spec.order}
        self.context = ReplicaContext(
            rank=rank,
            world_size=world_size,
            device=resolve_device(spec.device, rank),
            seed=spec.seed,
            collective=collective,
        )
        self.steps: dict[int, Any] = {}
        for name in self.order:
            self.stages[name].setup(self.context)

    def begin_phase(self, phase: PhaseContext) -> None:
        self.steps = {spec.index: spec for spec in phase.steps}
        for name in self.order:
            self.stages[name].begin_phase(self.context, phase)

    def run_window(self, first_step: int, stop_step: int) -> WindowResult:
        started = time.perf_counter()
        stage_seconds = dict.fromkeys(self.order, 0.0)
        samples, losses, seconds = [], [], []
        evals: dict[int, dict[str, float]] = {}
        rank = self.context.rank
        for index in range(first_step, stop_step):
            spec = self.steps[index]
            step_start = time.perf_counter()
            step_compute = 0.0
            step = StepContext(replica=self.context, spec=spec)
            for name in self.order:
                self.stages[name].begin_step(step)
            values: dict[str, Any] = {}
            for name in self.order:
                args = [values[parent] for parent in self.inputs[name]]
                t = time.perf_counter()
                try:
                    values[name] = self.stages[name].run(step, *args)
                except Exception as exc:
                    _add_note(exc, f"in stage {name!r} on replica {rank}, step {index}")
                    self.abort()  # peers waiting on this replica in a collective fail now
                    raise
                elapsed = time.perf_counter() - t
                stage_seconds[name] += elapsed
                if name not in self.waiting:
                    step_compute += elapsed
            if self.throttle > 1.0:  # a slow node, simulated: counted as compute
                pause = (self.throttle - 1.0) * step_compute
                time.sleep(pause)
                stage_seconds[THROTTLE] = stage_seconds.get(THROTTLE, 0.0) + pause
            seconds.append(time.perf_counter() - step_start)
            samples.append(spec.local_batches[rank])
            losses.append(step.metrics.get("loss"))
            if "eval" in step.metrics:
                evals[index] = step.metrics["eval"]
        return WindowResult(
            rank=rank,
            first_step=first_step,
            samples=samples,
            losses=_to_floats(losses),
            step_seconds=seconds,
            stage_seconds=stage_seconds,
            task_seconds=time.perf_counter() - started,
            evals=evals,
        )

    def end_phase(self) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        for name in self.order:
            stats.update(self.stages[name].end_phase(self.context))
        stats["weights_digest"] = self.weights_digest()  # after stages synced their state
        if self.context.optimizer is not None:
            stats["lr"] = self.context.optimizer.param_groups[0].get("lr")
        return stats

    def weights_digest(self) -> str:
        """A hash of every parameter's bytes: replicas must agree bit for bit."""
        digest = hashlib.blake2b(digest_size=16)
        if self.context.model is not None:
            for tensor in self.context.model.state_dict().values():
                digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        return digest.hexdigest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.context.model.state_dict().items()}

    def abort(self) -> None:
        if self.context.collective is not None:
            self.context.collective.abort()

    def close(self) -> None:
        for name in reversed(self.order):
            try:
                self.stages[name].teardown(self.context)
            except Exception:  # teardown is best effort: the fit already ended
                pass


def _to_floats(values: list[Any]) -> list[float | None]:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [None if v is None else float(v) for v in values]
    flat = iter(torch.stack([t.detach().float() for t in tensors]).cpu().tolist())
    return [next(flat) if isinstance(v, torch.Tensor) else v for v in values]


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def worker_host() -> str:
    plugin = current_plugin()
    return urlparse(plugin.worker.address).hostname or "127.0.0.1"


# -- Dask task functions (run on the replica's worker) --------------------------------


def open_rendezvous(run_id: str, world_size: int, timeout_s: float) -> tuple[str, int]:
    """On rank 0's worker: start the store on a free port; return where to reach it."""
    host = worker_host()
    store = open_store(host, world_size, timeout_s)
    current_plugin().stores[run_id] = store
    return host, store.port


def setup_replica(
    spec: ReplicaSpec, rank: int, world_size: int, host: str | None, port: int | None
) -> dict[str, Any]:
    """Join the process group and build the replica (model, optimizer, hooks)."""
    plugin = current_plugin()
    # Default: the worker's own thread budget (1 per process on the default LocalCluster),
    # so replicas sharing a node do not oversubscribe its cores.
    torch.set_num_threads(spec.threads or plugin.worker.state.nthreads)
    malloc_relaxed = spec.relax_malloc and needs_relaxing() and relax_malloc()
    collective = None
    if world_size > 1:
        if rank == 0:
            store = plugin.stores.pop(spec.run_id)
        else:
            store = connect_store(host, port, world_size, spec.collective_timeout_s)
        device = resolve_device(spec.device, rank)
        collective = Collective(
            store,
            rank=rank,
            world_size=world_size,
            device=device,
            host=worker_host(),
            timeout_s=spec.collective_timeout_s,
            prefix=spec.run_id,
        )
        collective.store = store  # keep rank 0's server alive as long as the group
    runtime = ReplicaRuntime(spec, rank=rank, world_size=world_size, collective=collective)
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


def begin_phase(run_id: str, phase: PhaseContext) -> int:
    current_plugin().replica(run_id).begin_phase(phase)
    return phase.index


def run_window(run_id: str, first_step: int, stop_step: int, after: Any = None) -> WindowResult:
    """Run steps ``[first_step, stop_step)``; ``after`` only orders it behind the last task."""
    return current_plugin().replica(run_id).run_window(first_step, stop_step)


def end_phase(run_id: str, after: Any = None) -> dict[str, Any]:
    return current_plugin().replica(run_id).end_phase()


def replica_state_dict(run_id: str) -> dict[str, torch.Tensor]:
    return current_plugin().replica(run_id).state_dict()


def abort_run(run_id: str, dask_worker: Any = None) -> None:
    """Via ``client.run`` (outside the task thread): break collectives of a failed fit."""
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    if plugin is not None:
        plugin.abort_run(run_id)


def close_run(run_id: str, dask_worker: Any = None) -> None:
    plugin = dask_worker.plugins.get("dataflow") if dask_worker is not None else None
    if plugin is not None:
        plugin.close_run(run_id)


def has_plugin(dask_worker: Any = None) -> bool:
    return "dataflow" in dask_worker.plugins
