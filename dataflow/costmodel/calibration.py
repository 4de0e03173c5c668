"""Measure a cost model's terms for one pipeline on one cluster (the driver side).

:func:`calibrate` sends probes (:mod:`dataflow.runtime.probe`) to the cluster's workers
and fits the terms of a :class:`~dataflow.costmodel.model.CostModel` from what they
measure; every term's ``notes`` entry says how. Dask, distributed and torch are imported
inside the functions only: the cost model itself stays importable without them.
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

from dataflow.core import kinds
from dataflow.core.errors import BatchSizeError, ConfigError, ModelError
from dataflow.costmodel.compute import ComputeFit, MemoryModel
from dataflow.costmodel.link_calibration import calibrated_topology
from dataflow.costmodel.model import MIB, CostModel
from dataflow.costmodel.screening import Screened, discarded_note, screen

DEFAULT_SIZES = (4, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
ROUND_TRIPS = 30  # chained no-op tasks timed for the window overhead
CALIBRATION_STEPS = 2  # 1-step windows each phase starts with (driver/machine.py)


def calibrate(
    pipe: Any,
    client: Any,
    *,
    batch_sizes: Sequence[int] | None = None,
    replicas: int | None = None,
    steps: int = 8,
    warmup: int = 3,
    repeats: int = 5,
    allreduce_sizes: Sequence[int] = DEFAULT_SIZES,
    allreduce_repeats: int = 7,
    name: str = "",
) -> CostModel:
    """A :class:`CostModel` of ``pipe`` (a :class:`dataflow.Pipeline` or ``Trainer``)
    measured on ``client``'s workers (a ``distributed.Client``).

    - compute: the pipe's own step (Load, transforms, Forward, loss, Backward, the
      optimizer's Update, the engine's per-step work) run as a fit runs it, on one
      worker with the fit's torch threads, at each of ``batch_sizes`` local batches
      (default: three spanning the schedule's local batches on ``replicas``), the
      median of ``repeats`` windows of ``steps`` steps after ``warmup`` steps (the
      batches take turns, so a burst of other work slows them alike);
      ``backward_fraction`` from the Backward stage's share of it;
    - the collective: the median time of allreduces of ``allreduce_sizes`` bytes with
      the engine's process group over ``replicas`` workers, fitted with
      ``t(n) = a + b n`` (Theil-Sen) and inverted through the ring closed form for
      ``W`` ranks: ``α = a / 2(W-1)``, ``β = 2(W-1)/W / b``;
    - a synchronous step: the pipe run as a fit of those ``W`` replicas at the same
      batches; what its step takes beyond the α-β allreduce (and ``sync_batchnorm``'s
      α-β reductions, ``batchnorm_channels``), fitted (Theil-Sen) as
      ``s × t_compute(b) + c``, gives ``compute.shared`` (``s``: replicas sharing a
      node slow each other) and ``sync_overhead_s`` (``c``: waiting for the slowest,
      the gradient hooks, the collective's wait loop);
    - the source's read rate (the Load stage alone), the engine's window overhead (a
      Dask round trip on a worker and a window's own work) and phase overhead,
      parameter bytes and activation bytes per sample (what autograd saves).

    Bad input raises a :class:`~dataflow.core.errors.DataflowError` naming the fix.
    """
    from distributed import Client

    trainer = getattr(pipe, "trainer", pipe)
    if not hasattr(trainer, "graph") or not hasattr(trainer, "schedule"):
        raise ConfigError(
            f"calibrate(pipe=...): expected a dataflow.Pipeline or Trainer, got "
            f"{type(pipe).__name__}"
        )
    if not isinstance(client, Client):
        raise ConfigError(
            f"calibrate(client=...): expected a distributed.Client connected to the cluster "
            f"the fit will run on, got {type(client).__name__}"
        )
    for field, value in (("steps", steps), ("repeats", repeats), ("warmup", warmup + 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"calibrate({field}={value!r}): must be an int >= 1")
    workers = _workers(client, replicas if replicas is not None else trainer.config.replicas)
    world = len(workers)
    config = trainer.config
    batches = _batch_sizes(trainer, batch_sizes, world)
    gradient_bytes, parameter_bytes, batchnorm = _parameters(trainer)
    source = trainer.source
    notes: dict[str, str] = {}

    from dataflow.runtime import probe

    order = tuple(n for n in trainer.graph.validate(replicas=1) if _trains(trainer.graph[n]))
    request = probe.StepProbe(
        graph=trainer.graph,
        order=order,
        seed=config.seed,
        batches=batches,
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        threads=config.threads_per_replica,
        device=config.device,
        commit_windows=config.recover_lost_workers,
    )
    shipped = _ship(client, request, workers)  # the graph (and its source) sent once
    measured = _on(client, workers[0], probe.time_steps, shipped)
    per_batch = measured["batches"]
    screened = _screen(per_batch, batches, "compute")
    points = screened.points
    fractions = [w["backward_fraction"] for b in batches for w in per_batch[b]["windows"]]
    backward = statistics.median(fractions)
    where = f"worker {workers[0]}, {measured['torch_threads']} torch thread(s)"
    notes["compute"] = (
        f"the pipe's step (load, transforms, forward, loss, backward, update) at local "
        f"batches {list(batches)} on {where}: median of {repeats} windows of {steps} steps "
        "(the batches taking turns) "
        f"after {warmup} warm-up steps, less the wait on Load; {screened.note()}"
    )
    notes["backward_fraction"] = "the Backward stage's median share of that step"

    read = _on(client, workers[0], probe.read_rate, shipped)
    notes["load_samples_per_s"] = (
        f"the Load stage alone (read, shuffle buffer, prefetch thread) at {read['batch']} "
        f"samples per batch on {workers[0]}: median seconds per batch"
    )

    topology, link_note = calibrated_topology(
        client, workers, allreduce_sizes, allreduce_repeats, config
    )
    notes["topology"] = link_note

    window_s, phase_s, overhead_note = _overheads(client, workers[0], per_batch)
    notes["window_overhead_s"] = overhead_note
    notes["phase_overhead_s"] = (
        f"{CALIBRATION_STEPS + 2} round trips (begin phase, end phase, the phase's "
        f"{CALIBRATION_STEPS} one-step calibration windows) plus the replica's measured "
        "begin- and end-of-phase work"
    )

    saved = sorted((b, per_batch[b]["saved_bytes"]) for b in batches)
    activation = _activation_per_sample(saved)
    notes["memory"] = (
        "weights: the model's parameters; activations: bytes autograd saves for backward "
        f"in one step (each storage once), slope over local batches {[b for b, _ in saved]}; "
        f"optimizer states: {measured['optimizer_states']} weight-sized tensor(s) per "
        "parameter after a step"
    )
    notes["gradient_bytes"] = "the trainable parameters' bytes (what the buckets reduce)"
    reducers = [s for s in trainer.graph if s.kind == kinds.ALLREDUCE]
    bucket_mb = getattr(reducers[0], "bucket_mb", 25.0) if reducers else 25.0
    bucket_mb = bucket_mb if isinstance(bucket_mb, int | float) else 25.0
    model = CostModel(
        compute=ComputeFit(
            points=points,
            backward_fraction=backward,
            source=f"calibrated: {where}",
        ),
        gradient_bytes=gradient_bytes,
        topology=topology,
        bucket_bytes=max(1, int(bucket_mb * MIB)),
        load_samples_per_s=read["samples_per_s"],
        window_overhead_s=window_s,
        phase_overhead_s=phase_s + CALIBRATION_STEPS * window_s,
        window_seconds=float(config.window_seconds or 1.0),
        window_steps=config.window_steps,
        max_micro_batch=config.max_micro_batch if isinstance(config.max_micro_batch, int) else None,
        memory=MemoryModel(
            parameter_bytes=parameter_bytes,
            activation_bytes_per_sample=activation,
            optimizer_states=int(measured["optimizer_states"]),
        ),
        name=name or _model_name(trainer),
        notes={**notes, "samples_per_epoch": str(source.num_samples)},
        discarded=screened.discarded,
        batchnorm_channels=batchnorm,
    )
    model = _synchronous(client, workers, request, model, source.num_samples)
    model = model.replace(notes={**model.notes, "discarded": discarded_note(model.discarded)})
    if config.window_seconds is None:  # what the fit plans from this model
        from dataflow.costmodel.best_settings import window_seconds

        model = model.replace(window_seconds=window_seconds(model))
    return model


# -- the pieces -------------------------------------------------------------------------


def _workers(client: Any, replicas: int | None) -> list[str]:
    from dataflow.runtime.cluster import available_workers

    workers = available_workers(client)
    if not workers:
        raise ConfigError(
            "calibrate: the client has no workers; start some first (cluster.scale(n), "
            "client.wait_for_workers(n)) on the machines the fit will run on"
        )
    if replicas is not None:
        if replicas > len(workers):
            raise ConfigError(
                f"calibrate(replicas={replicas}): the client has {len(workers)} worker(s); "
                "start more workers or lower replicas"
            )
        workers = workers[:replicas]
    return workers


def _trains(stage: Any) -> bool:
    """Stages of the timed step: all but evaluation (it runs once per epoch)."""
    return type(stage).__name__ != "Evaluate"


def _batch_sizes(trainer: Any, given: Sequence[int] | None, world: int) -> tuple[int, ...]:
    num_samples = trainer.source.num_samples
    if given is not None:
        sizes = sorted(set(given))
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ConfigError(
                f"calibrate(batch_sizes={list(given)!r}): give local batch sizes, ints >= 1"
            )
    else:
        first = trainer.planner().next_phase(0, 1, None).global_batch
        low = max(1, first // world)
        high = max(low, trainer.schedule.max_batch())
        if high < 2 * low:
            low = max(1, high // 2)
        mid = round(math.sqrt(low * high))
        sizes = sorted({low, mid, high})
        sizes = [min(b, num_samples) for b in sizes]
        sizes = sorted(set(sizes))
    if sizes[-1] > num_samples:
        raise BatchSizeError(
            f"calibrate(batch_sizes={sizes}): a local batch of {sizes[-1]} is larger than the "
            f"source ({num_samples} samples); use batch sizes <= {num_samples}"
        )
    return tuple(sizes)


def _parameters(trainer: Any) -> tuple[int, int, tuple[int, ...]]:
    """(trainable bytes, all parameter bytes, and with ``sync_batchnorm`` the channels of
    each BatchNorm layer) of the model, built on the driver."""
    from torch import nn

    from dataflow.stages.forward import Forward, build_model

    if trainer.model_factory is None:
        raise ConfigError("calibrate: the graph has no Forward stage, so no model to time")
    model = build_model(trainer.model_factory, trainer.config.seed)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ModelError(
            f"calibrate: the model {type(model).__name__} has no trainable parameters "
            f"({len(params)} parameter tensor(s), none with requires_grad=True), so there is "
            "no training step to time; unfreeze some (p.requires_grad_(True)) or give a "
            "model with parameters"
        )
    synced = any(s.config.sync_batchnorm for s in trainer.graph if isinstance(s, Forward))
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return (
        sum(p.numel() * p.element_size() for p in trainable),
        sum(p.numel() * p.element_size() for p in params),
        tuple(m.num_features for m in norms) if synced else (),
    )


def _ship(client: Any, value: Any, workers: list[str], timeout_s: float = 60.0) -> Any:
    """``value`` sent once (a future), not pickled into each task: to one of ``workers``;
    the others fetch it from there when their task needs it. Not broadcast: the
    scheduler retries a broadcast's copy to a worker that died meanwhile forever."""
    return client.scatter(value, workers=list(workers), hash=False, timeout=timeout_s)


def _on(client: Any, worker: str, fn: Any, *args: Any) -> Any:
    future = client.submit(fn, *args, workers=[worker], allow_other_workers=False, pure=False)
    return future.result()


def _synchronous(
    client: Any, workers: list[str], request: Any, model: CostModel, num_samples: int
) -> CostModel:
    """``compute.shared`` and ``sync_overhead_s`` from real synchronous steps: the pipe
    run as a fit of ``W`` replicas (its process group, gradient hooks and allreduce) at
    the calibration's local batches. What a step takes beyond the α-β allreduce (and
    ``sync_batchnorm``'s reductions) is fitted as ``s × t_compute(b) + c``: ``s`` the
    slowdown of replicas sharing a node, ``c`` a synchronous step's own cost (waiting for
    the slowest replica, the hooks' copies into buckets, the collective's wait loop)."""
    import dataclasses

    from dataflow.runtime import probe
    from dataflow.runtime.tasks import open_rendezvous

    world = len(workers)
    notes = dict(model.notes)
    if world < 2:
        notes["sync_overhead_s"] = "not measured: one worker, no synchronous step"
        return model.replace(notes=notes)
    cap = num_samples // world
    sizes = sorted(b for b in request.batches if b <= cap)
    if not sizes:
        notes["sync_overhead_s"] = f"not measured: too few samples for {world} replicas"
        return model.replace(notes=notes)
    run_id = f"calibrate-{uuid.uuid4().hex[:8]}"
    timeout = 60.0
    host, port = client.submit(
        open_rendezvous, run_id, world, timeout, workers=[workers[0]], pure=False
    ).result()
    together = _ship(
        client, dataclasses.replace(request, batches=tuple(sizes), memory=False), workers
    )
    futures = [
        client.submit(
            probe.time_steps,
            together,
            probe.Group(run_id, rank, world, host, port, timeout),
            workers=[worker],
            allow_other_workers=False,
            pure=False,
        )
        for rank, worker in enumerate(workers)
    ]
    ranks = client.gather(futures)
    screens = [
        _screen(r["batches"], sizes, f"synchronous step, rank {rank}")
        for rank, r in enumerate(ranks)
    ]
    discarded = model.discarded + tuple(d for x in screens for d in x.discarded)
    steps = [dict(x.points) for x in screens]
    sizes = [b for b in sizes if all(b in p for p in steps)]
    if not sizes:
        notes["sync_overhead_s"] = "not measured: no plausible synchronous step (see discarded)"
        return model.replace(notes=notes, discarded=discarded)
    alone, rest = [], []
    for b in sizes:
        step = max(p[b] for p in steps)
        predicted = model.breakdown(replicas=world, global_batch=b * world)
        alone.append(model.compute.seconds(b))
        rest.append(step - predicted.allreduce_exposed_s - predicted.batchnorm_s)
    slope, extra = _scale_and_offset(alone, rest)
    local = model.topology.local(world)
    compute = dataclasses.replace(model.compute, shared=((local, slope),))
    rows = ", ".join(
        f"b={b}: {r * 1e3:.2f} ms beyond the allreduce vs {a * 1e3:.2f} ms alone"
        for b, a, r in zip(sizes, alone, rest, strict=True)
    )
    notes["shared"] = (
        f"{world} replicas as one synchronous fit ({rows}): a step beyond the α-β "
        f"allreduce = s × t_compute(b) + c, s = {slope:.3f} ({local} replicas per node)"
    )
    notes["sync_overhead_s"] = f"c = {extra * 1e3:.3f} ms, of the same fit (see shared)"
    return model.replace(compute=compute, sync_overhead_s=extra, notes=notes, discarded=discarded)


def _scale_and_offset(alone: list[float], rest: list[float]) -> tuple[float, float]:
    """``(s, c)`` with ``rest ≈ s × alone + c``, ``s >= 1`` and ``c >= 0``, robust to one
    disturbed point (Theil-Sen: the median slope between pairs, the median offset)."""
    pairs = sorted(zip(alone, rest, strict=True))
    slopes = [
        (r1 - r0) / (a1 - a0)
        for i, (a0, r0) in enumerate(pairs)
        for a1, r1 in pairs[i + 1 :]
        if a1 > a0
    ]
    slope = max(1.0, statistics.median(slopes)) if slopes else 1.0
    extra = statistics.median(r - slope * a for a, r in pairs)
    if extra < 0:  # the extra grows with the batch: a slowdown alone
        return max(1.0, statistics.median(r / a for a, r in pairs)), 0.0
    return slope, extra


def _screen(per_batch: dict[int, Any], batches: Sequence[int], term: str) -> Screened:
    """The median window of each batch, implausible windows left out (and said)."""
    samples = {b: [w["compute_s"] for w in per_batch[b]["windows"]] for b in batches}
    screened = screen(samples, term=term)
    if not screened.points:
        raise ModelError(f"calibrate: no plausible {term} time was measured ({screened.note()})")
    return screened


def _overheads(client: Any, worker: str, per_batch: dict[int, Any]) -> tuple[float, float, str]:
    """(window overhead, phase work, note): a Dask round trip between chained tasks on
    ``worker`` plus a window's own work on the replica (its task time less its steps)."""
    from dataflow.runtime import probe

    def chain(count: int) -> float:
        started = time.perf_counter()
        future = None
        for _ in range(count):
            future = client.submit(
                probe.noop, future, workers=[worker], allow_other_workers=False, pure=False
            )
        future.result()
        return (time.perf_counter() - started) / count

    chain(5)  # warm
    round_trip = min(chain(ROUND_TRIPS) for _ in range(3))
    in_task = statistics.median(w["window_s"] for b in per_batch.values() for w in b["windows"])
    phase = statistics.median(w["phase_s"] for b in per_batch.values() for w in b["windows"])
    note = (
        f"a Dask round trip between chained tasks on {worker} ({round_trip * 1e3:.2f} ms, "
        f"best of 3 chains of {ROUND_TRIPS}) plus a window's own work on the replica (its "
        f"task time less its steps: the commit of the state, {in_task * 1e3:.2f} ms, median)"
    )
    return round_trip + in_task, 2 * round_trip + phase, note


def _activation_per_sample(saved: list[tuple[int, int]]) -> int:
    if len(saved) == 1:
        batch, total = saved[0]
        return max(0, total // batch)
    (b0, t0), (b1, t1) = saved[0], saved[-1]
    return max(0, round((t1 - t0) / (b1 - b0)))


def _model_name(trainer: Any) -> str:
    factory = trainer.model_factory
    return getattr(factory, "__name__", type(factory).__name__)
