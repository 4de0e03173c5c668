"""The worker side of a calibration (:func:`dataflow.costmodel.calibrate`): time the
user's step, the source's read rate and the collective where a fit would run them.

Each probe is a plain Dask task pinned to one worker. It builds a replica exactly as a
fit does (:class:`~dataflow.runtime.replica.ReplicaRuntime` from the pipe's graph, the
same torch threads, malloc setting, frozen collector and paused profiler) and runs
windows of real steps on real samples, so what it times is what a fit's steps cost:
forward, loss, backward, the optimizer step and the engine's own per-step and
per-window work. Only small results (seconds, bytes) go back to the driver.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import uuid
from typing import Any

import torch

from dataflow.core import kinds
from dataflow.core.errors import DataflowError, ModelError
from dataflow.core.phase import PhaseSpec
from dataflow.core.step import PhaseContext
from dataflow.planning.plan import phase_steps
from dataflow.runtime.collective import Collective, connect_store
from dataflow.runtime.malloc import needs_relaxing, relax_malloc
from dataflow.runtime.plugin import current_plugin
from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec, resolve_device
from dataflow.runtime.tasks import group_key, worker_host
from dataflow.stages.backward import Backward


@dataclasses.dataclass(frozen=True)
class StepProbe:
    """What to time on one worker: ``batches`` (local batch sizes) in ``repeats`` rounds,
    each one window of ``steps`` steps per batch after ``warmup`` steps left out."""

    graph: Any
    order: tuple[str, ...]
    seed: int
    batches: tuple[int, ...]
    steps: int = 4
    warmup: int = 3
    repeats: int = 3
    threads: int | None = None
    device: str = "auto"
    commit_windows: bool = True
    memory: bool = True  # also count the bytes autograd saves (one more step per batch)


def _prepare(threads: int | None, run_id: str) -> dict[str, Any]:
    """The worker as a fit's replica finds it (see ``runtime.tasks._setup``)."""
    plugin = current_plugin()
    torch.set_num_threads(threads or plugin.worker.state.nthreads)
    relaxed = needs_relaxing() and relax_malloc()
    plugin.pause_profiler(run_id)
    gc.collect()
    gc.freeze()
    return {
        "worker": plugin.worker.address,
        "torch_threads": torch.get_num_threads(),
        "malloc_relaxed": relaxed,
    }


def _steps(num_samples: int, batch: int, count: int, world: int = 1) -> tuple[Any, ...]:
    """``count`` full steps of ``batch`` samples per replica (as many epochs as that
    takes), none the last of its epoch (no evaluation runs in a probe)."""
    per_epoch = num_samples // (batch * world)
    epochs = -(-count // per_epoch)
    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=epochs, global_batch=batch * world)
    steps = phase_steps(
        num_samples=num_samples,
        phase=phase,
        split=lambda n: (n // world,) * world,
        drop_last=True,
    )
    return tuple(dataclasses.replace(s, last_in_epoch=False) for s in steps[:count])


def _runtime(
    probe: StepProbe, order: tuple[str, ...], run_id: str, group: Group | None = None
) -> ReplicaRuntime:
    spec = ReplicaSpec(
        run_id=run_id,
        graph=probe.graph.shallow_copy(),
        order=order,
        seed=probe.seed,
        device=probe.device,
        threads=probe.threads,
        commit_windows=probe.commit_windows,
    )
    if group is None:
        return ReplicaRuntime(spec, rank=0, world_size=1, collective=None)
    collective = group.join(probe.threads, probe.device)
    return ReplicaRuntime(spec, rank=group.rank, world_size=group.world, collective=collective)


class _SavedBytes:
    """Bytes autograd saves for backward (each storage once): the activations a step
    holds between forward and backward."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _load_names(probe: StepProbe, order: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in order if probe.graph[n].kind == kinds.LOAD)


def _time_window(
    runtime: ReplicaRuntime,
    probe: StepProbe,
    steps: tuple[Any, ...],
    loads: tuple[str, ...],
    warmup: int,
) -> dict[str, Any]:
    """A phase of ``warmup`` steps left out and one window of ``probe.steps`` steps: the
    compute seconds per step (step time less the wait on Load), Load's wait, backward's
    share, the window's own cost (its task time less its steps), and the phase's begin
    and end."""
    began = time.perf_counter()
    runtime.begin_phase(PhaseContext(index=0, steps=steps, lr=None))
    begin_s = time.perf_counter() - began
    first = steps[0].index
    if warmup:
        runtime.run_window(first, first + warmup)
    result = runtime.run_window(first + warmup, first + warmup + probe.steps)
    ended = time.perf_counter()
    runtime.end_phase()
    end_s = time.perf_counter() - ended
    stages = result.stage_seconds
    wait = sum(stages.get(n, 0.0) for n in loads)
    stepped = sum(result.step_seconds)
    backward = sum(stages.get(n, 0.0) for n in _backward_names(runtime))
    compute = max(1e-9, stepped - wait)
    return {
        "compute_s": compute / probe.steps,
        "step_s": stepped / probe.steps,
        "load_wait_s": wait / probe.steps,
        "backward_fraction": min(1.0, backward / compute),
        "window_s": max(0.0, result.task_seconds - stepped),
        "step_compute": [max(1e-9, s - wait / probe.steps) for s in result.step_seconds],
        "phase_s": begin_s + end_s,
    }


def _backward_names(runtime: ReplicaRuntime) -> list[str]:
    return [n for n, stage in runtime.stages.items() if isinstance(stage, Backward)]


def _saved_bytes(runtime: ReplicaRuntime, steps: tuple[Any, ...]) -> int:
    """One more step with autograd's pack hook counting what forward saves."""
    counter = _SavedBytes()
    runtime.begin_phase(PhaseContext(index=0, steps=steps[-1:], lr=None))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        runtime.run_window(steps[-1].index, steps[-1].index + 1)
    runtime.end_phase()
    return counter.total


def time_steps(probe: StepProbe, group: Group | None = None) -> dict[str, Any]:
    """The user's step at each local batch of ``probe`` on this worker (see
    :class:`StepProbe`), the optimizer's state count and the activation bytes; with
    ``group``, as one replica of a synchronous fit (every rank runs this at once).

    The batches take turns: a warm-up round, then ``repeats`` rounds, each one window
    per batch (after ``warmup`` steps in the warm-up round, one in the others), so a
    burst of other work on the machine slows every batch's timings alike rather than one
    batch's all."""
    run_id = f"probe-{uuid.uuid4().hex[:8]}"
    info = _prepare(probe.threads, run_id)
    plugin = current_plugin()
    loads = _load_names(probe, probe.order)
    num_samples = probe.graph[loads[0]].source.num_samples if loads else 0
    runtime = None
    results: dict[int, Any] = {b: {"windows": []} for b in probe.batches}
    batch = probe.batches[0]
    world = 1 if group is None else group.world
    try:
        try:
            runtime = _runtime(probe, probe.order, run_id, group)
            count = probe.warmup + probe.steps
            # Round 0 is warm-up, not kept: fresh workers run a fit's first steps of each
            # shape 8-20 % slower (first-touch pages, oneDNN's per-shape primitives), and
            # a fit is timed long after them.
            for round_ in range(probe.repeats + 1):
                for batch in probe.batches:
                    steps = _steps(num_samples, batch, count + 1, world)
                    warmup = probe.warmup if round_ == 0 else min(1, probe.warmup)
                    window = _time_window(runtime, probe, steps[:count], loads, warmup)
                    if round_ > 0:
                        results[batch]["windows"].append(window)
                    if round_ == 0 and probe.memory and group is None:
                        results[batch]["saved_bytes"] = _saved_bytes(runtime, steps)
        except DataflowError:
            raise
        except Exception as exc:  # the user's model, loss or optimizer failed
            raise ModelError(
                f"calibrate: a training step of the model failed on worker "
                f"{info['worker']} at a local batch of {batch} samples: "
                f"{type(exc).__name__}: {exc}. Fix the model, loss or optimizer until "
                "one step runs (pipe.fit's dry run shows the same error on the driver "
                "with a plain traceback)"
            ) from exc
        info["optimizer_states"] = _optimizer_states(runtime)
    finally:
        if runtime is not None:
            runtime.close()
            if runtime.context.collective is not None:  # never destroyed mid-wait
                plugin.retired_groups.append(runtime.context.collective)
        plugin.close_run(run_id)
    return {**info, "batches": results}


def _optimizer_states(runtime: ReplicaRuntime) -> int:
    """Copies of the weights the optimizer keeps (1: momentum, 2: Adam's moments)."""
    optimizer = runtime.context.optimizer
    if optimizer is None:
        return 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.numel() > 1 and param in optimizer.state:
                state = optimizer.state[param]
                return sum(
                    1
                    for v in state.values()
                    if isinstance(v, torch.Tensor) and v.numel() == param.numel()
                )
    return 0


def read_rate(probe: StepProbe) -> dict[str, Any]:
    """Samples/s of the Load stage alone (read, shuffle buffer, prefetch thread): the
    steady rate at which one replica's loader delivers batches of ``probe.batches[-1]``."""
    run_id = f"probe-{uuid.uuid4().hex[:8]}"
    _prepare(probe.threads, run_id)
    loads = _load_names(probe, probe.order)
    num_samples = probe.graph[loads[0]].source.num_samples
    batch = probe.batches[-1]
    runtime = _runtime(probe, loads, run_id)
    try:
        steps = _steps(num_samples, batch, probe.warmup + probe.steps * probe.repeats)
        runtime.begin_phase(PhaseContext(index=0, steps=steps, lr=None))
        runtime.run_window(steps[0].index, steps[0].index + probe.warmup)
        first = steps[probe.warmup].index
        result = runtime.run_window(first, steps[-1].index + 1)
        runtime.end_phase()
    finally:
        runtime.close()
        current_plugin().close_run(run_id)
    per_step = statistics.median(result.step_seconds)
    return {"batch": batch, "seconds_per_batch": per_step, "samples_per_s": batch / per_step}


@dataclasses.dataclass(frozen=True)
class Group:
    """Rank ``rank`` of a ``world``-rank process group whose rank 0 opened its
    rendezvous store with :func:`dataflow.runtime.tasks.open_rendezvous` under
    ``run_id`` at ``host:port``."""

    run_id: str
    rank: int
    world: int
    host: str
    port: int
    timeout_s: float = 60.0

    def join(self, threads: int | None = None, device: str = "auto") -> Collective:
        """This rank's process group, as a fit's replica joins it (gloo on CPU, NCCL on
        a GPU)."""
        plugin = current_plugin()
        torch.set_num_threads(threads or plugin.worker.state.nthreads)
        key = group_key(self.run_id, 0)
        if self.rank == 0:
            store = plugin.stores.pop(key)
        else:
            store = connect_store(self.host, self.port, self.world, self.timeout_s)
        collective = Collective(
            store,
            rank=self.rank,
            world_size=self.world,
            device=resolve_device(device, self.rank),
            host=worker_host(),
            timeout_s=self.timeout_s,
            prefix=key,
        )
        collective.store = store  # rank 0's server lives as long as the group
        return collective


def allreduce_times(
    group: Group,
    sizes: tuple[int, ...],
    repeats: int,
    threads: int | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Median seconds of one sum-allreduce of each of ``sizes`` bytes (float32) with
    the engine's own :class:`~dataflow.runtime.collective.Collective` (gloo on CPU,
    NCCL on a GPU), on the device a fit's replica would use."""
    plugin = current_plugin()
    collective = group.join(threads, device)
    where = collective.device
    out: dict[int, float] = {}
    try:
        for size in sizes:
            tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=where)
            for _ in range(3):  # warm-up (buffers, connections)
                collective.allreduce(tensor)
            times = []
            for _ in range(repeats):
                collective.allreduce(torch.zeros(1, device=where))  # line the ranks up
                _synchronize(where)
                t = time.perf_counter()
                collective.allreduce(tensor)
                _synchronize(where)
                times.append(time.perf_counter() - t)
            out[size] = statistics.median(times)
    finally:
        plugin.retired_groups.append(collective)  # destroyed with the worker, never mid-wait
    return {"times": out, "backend": collective.backend}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def noop(previous: Any = None) -> int:
    """A task that does nothing: a chain of them times the Dask round trip between one
    window and the next on the same worker."""
    return 0
