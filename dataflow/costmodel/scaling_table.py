"""The tables ``dataflow scale`` prints: per worker count, each phase of the schedule
(its epochs, global and local batch, step and terms, its time), the whole schedule's
samples/s, efficiency and time to train, and where the lost efficiency goes.

Efficiency is the time ideal workers would take (each as fast as one worker alone at
the same local batch) over the predicted time. What the workers lose is split by cause
(:func:`losses`): compute slowed by workers sharing a node, the exposed allreduce, a
synchronous step's own cost, the engine's overheads, waiting on data, an uneven split,
phase changes. The causes add up exactly: efficiency + each cause's share = 100 %.
Pure: no torch, no Dask.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dataflow.core.errors import ConfigError
from dataflow.costmodel.model import MIB, CostModel, StepBreakdown
from dataflow.costmodel.scaling import _check_phases, _table

EFFICIENT = 0.8  # below this a row's efficiency is explained under the table
SHOWN_SHARE = 0.005  # causes under half a percent of the time are left out of the notes


def losses(model: CostModel, *, replicas: int, global_batch: int) -> dict[str, float]:
    """Seconds per step that ``replicas`` workers pay beyond ideal ones (one worker
    alone at the same local batch, for ``global_batch / replicas`` samples each), by
    cause. They add up to the step less the ideal step (some can be negative: a slower
    compute hides more of the data wait)."""
    step = model.breakdown(replicas=replicas, global_batch=global_batch)
    one = model.breakdown(replicas=1, global_batch=step.local_batch)
    ideal = one.step_s * global_batch / (replicas * step.local_batch)
    return {
        "node sharing": step.compute_s - one.compute_s,
        "allreduce": step.allreduce_exposed_s - one.allreduce_exposed_s,
        "sync": step.sync_s - one.sync_s,
        "batchnorm": step.batchnorm_s - one.batchnorm_s,
        "overhead": step.overhead_s - one.overhead_s,
        "data": step.data_wait_s - one.data_wait_s,
        "uneven split": one.step_s - ideal,
    }


@dataclass(frozen=True)
class PhaseRow:
    """One phase on ``replicas`` workers: its epochs, its step, its time (seconds,
    phase overhead included) and what it loses by cause (seconds over the phase)."""

    replicas: int
    start_epoch: float
    end_epoch: float
    samples: int
    step: StepBreakdown
    efficiency: float
    seconds: float
    lost: Mapping[str, float]

    @property
    def epochs(self) -> str:
        return f"{_epoch(self.start_epoch)}-{_epoch(self.end_epoch)}"


@dataclass(frozen=True)
class TrainRow:
    """The whole schedule on ``replicas`` workers: its phases, its time to train, its
    efficiency (ideal time over predicted time) and what it loses by cause."""

    replicas: int
    nodes: int
    phases: tuple[PhaseRow, ...]
    seconds: float
    efficiency: float
    lost: Mapping[str, float]

    @property
    def samples(self) -> int:
        return sum(p.samples for p in self.phases)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def _phase(
    model: CostModel, replicas: int, batch: int, samples: int, start: float, end: float
) -> PhaseRow:
    step = model.breakdown(replicas=replicas, global_batch=batch)
    steps = samples / batch
    lost = {k: v * steps for k, v in losses(model, replicas=replicas, global_batch=batch).items()}
    lost["phase changes"] = model.phase_overhead_s
    ideal = steps * step.step_s - sum(v for k, v in lost.items() if k != "phase changes")
    return PhaseRow(
        replicas=replicas,
        start_epoch=start,
        end_epoch=end,
        samples=samples,
        step=step,
        efficiency=ideal / (steps * step.step_s) if step.step_s > 0 else 1.0,
        seconds=steps * step.step_s + model.phase_overhead_s,
        lost=lost,
    )


def _whole(model: CostModel, replicas: int, phases: Sequence[PhaseRow]) -> TrainRow:
    seconds = sum(p.seconds for p in phases)
    lost = {k: sum(p.lost[k] for p in phases) for k in phases[0].lost}
    return TrainRow(
        replicas=replicas,
        nodes=model.topology.nodes(replicas),
        phases=tuple(phases),
        seconds=seconds,
        efficiency=(seconds - sum(lost.values())) / seconds if seconds > 0 else 1.0,
        lost=lost,
    )


def schedule_rows(
    model: CostModel,
    *,
    phases: Sequence[tuple[int, int]],
    samples_per_epoch: int,
    counts: Iterable[int],
) -> list[TrainRow]:
    """Every worker count of ``counts`` running the schedule ``phases`` (``[(global
    batch, samples), ...]``, one after another from epoch 0), phase by phase. Counts
    above the smallest phase batch are left out (a worker would get no sample)."""
    _check_phases(phases)
    _check_epoch_size(samples_per_epoch)
    smallest = min(b for b, _ in phases)
    rows = []
    for w in (c for c in sorted(set(counts)) if c <= smallest):
        done, parts = 0, []
        for batch, samples in phases:
            start, done = done, done + samples
            parts.append(
                _phase(
                    model, w, batch, samples, start / samples_per_epoch, done / samples_per_epoch
                )
            )
        rows.append(_whole(model, w, parts))
    return rows


def weak_rows(
    model: CostModel,
    *,
    local_batch: int,
    epochs: float,
    samples_per_epoch: int,
    counts: Iterable[int],
) -> list[TrainRow]:
    """Every worker count at ``local_batch`` per worker (the global batch grows with
    them), each training ``epochs`` epochs of ``samples_per_epoch`` samples."""
    if isinstance(local_batch, bool) or not isinstance(local_batch, int) or local_batch < 1:
        raise ConfigError(f"local_batch={local_batch!r}: an int >= 1")
    _check_epoch_size(samples_per_epoch)
    samples = round(epochs * samples_per_epoch)
    return [
        _whole(model, w, [_phase(model, w, local_batch * w, samples, 0.0, float(epochs))])
        for w in sorted(set(counts))
    ]


def _check_epoch_size(samples_per_epoch: object) -> None:
    if isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, int):
        raise ConfigError(f"samples_per_epoch={samples_per_epoch!r}: an int >= 1")
    if samples_per_epoch < 1:
        raise ConfigError(f"samples_per_epoch={samples_per_epoch}: an int >= 1")


# -- printing ----------------------------------------------------------------------------

HEADER = (
    "workers", "nodes", "epochs", "global", "local", "step ms", "samples/s", "eff",
    "compute", "data", "allreduce", "exposed", "sync", "overhead", "time", "lost mostly to",
)  # fmt: skip


def _cells(p: PhaseRow) -> list[str]:
    s = p.step
    return [
        p.epochs,
        str(s.global_batch),
        str(s.local_batch),
        f"{s.step_s * 1e3:.1f}",
        f"{s.samples_per_second:,.0f}",
        f"{p.efficiency:.1%}",
        f"{s.compute_s * 1e3:.1f}",
        f"{s.data_wait_s * 1e3:.1f}",
        f"{s.allreduce_s * 1e3:.1f}",
        f"{s.allreduce_exposed_s * 1e3:.1f}",
        f"{s.sync_s * 1e3:.1f}",
        f"{s.overhead_s * 1e3:.2f}",
        duration(p.seconds),
        _most(p.lost, p.seconds),
    ]


def format_table(rows: Sequence[TrainRow]) -> str:
    """One line per worker count with one phase; with several, a line per phase (its
    epochs, batch, step, terms and time) and an ``all`` line: the schedule's samples/s,
    efficiency and time to train."""
    cells: list[list[str]] = []
    for r in rows:
        head = [str(r.replicas), str(r.nodes)]
        for i, p in enumerate(r.phases):
            cells.append([*(head if i == 0 else ["", ""]), *_cells(p)])
        if len(r.phases) > 1:
            whole = ["", "", "all", "", "", "", f"{r.samples_per_second:,.0f}"]
            whole += [f"{r.efficiency:.1%}", *[""] * 6, duration(r.seconds)]
            cells.append([*whole, _most(r.lost, r.seconds)])
    return _table(cells, HEADER)


def _top(lost: Mapping[str, float]) -> str:
    return max(lost.items(), key=lambda kv: kv[1])[0]


def _efficiency(row: TrainRow) -> float:
    """The efficiency the table shows: per step for one phase, the schedule's else."""
    return row.phases[0].efficiency if len(row.phases) == 1 else row.efficiency


def _most(lost: Mapping[str, float], seconds: float) -> str:
    cause = _top(lost)
    value = lost[cause]
    share = value / seconds if seconds > 0 else 0.0
    return f"{cause} {share:.1%}" if share >= SHOWN_SHARE else "-"


def time_to_train(rows: Sequence[TrainRow], what: str) -> str:
    """The line under the table: the schedule's time on the fewest and the most workers."""
    first, last = rows[0], rows[-1]
    line = f"time to train {what}: {duration(first.seconds)} on {_workers(first.replicas)}"
    if last is not first:
        line += f", {duration(last.seconds)} on {_workers(last.replicas)}"
        line += f" ({first.seconds / last.seconds:,.1f}x faster)"
    return line


def explain(model: CostModel, rows: Sequence[TrainRow]) -> list[str]:
    """Notes under the table: what ``eff`` and ``lost mostly to`` mean, and for the
    fewest workers under 80 % efficiency (and the most, when another cause leads there)
    where their time goes, cause by cause, with the model's figures behind each."""
    out = [
        "eff: the time ideal workers would take (each as fast as one worker alone at the "
        "same local batch) over the predicted time; 'lost mostly to': the cause of most "
        "of the rest, as a share of the time (eff + all causes = 100 %)"
    ]
    low = [r for r in rows if _efficiency(r) < EFFICIENT]
    picked = low[:1]
    if len(low) > 1 and _top(low[-1].lost) != _top(low[0].lost):
        picked.append(low[-1])
    for r in picked:
        causes = sorted(r.lost.items(), key=lambda kv: -kv[1])
        shown = [(k, v) for k, v in causes if v / r.seconds >= SHOWN_SHARE]
        top = max(r.phases, key=lambda p: p.seconds)
        where = (
            f" ({len(r.phases)} phases; the longest, epochs {top.epochs}, at local batch "
            f"{top.step.local_batch})"
            if len(r.phases) > 1
            else f" (local batch {top.step.local_batch})"
        )
        out.append(
            f"why {_workers(r.replicas)} reach {_efficiency(r):.1%}{where}: of "
            f"{duration(r.seconds)}, {duration(sum(v for _, v in shown))} go to"
        )
        out += [
            f"  - {k} {duration(v)} ({v / r.seconds:.1%}): {_cause(model, k, r, top)}"
            for k, v in shown
        ]
    return out


def _cause(model: CostModel, cause: str, row: TrainRow, phase: PhaseRow) -> str:
    topo, step, replicas = model.topology, phase.step, row.replicas
    if cause == "node sharing":
        local = topo.local(replicas)
        measured = "measured by calibrate" if "shared" in model.notes else "given"
        return (
            f"{local} workers computing on one node at once each run "
            f"{model.compute.slowdown(local):.2f}x slower than one alone (compute.shared, "
            f"{measured})"
        )
    if cause == "allreduce":
        return (
            f"the part of the gradients' allreduce ({model.gradient_bytes / MIB:.2f} MiB, "
            f"{topo.algorithm} over {topo.nodes(replicas)} node(s), "
            f"{step.allreduce_s * 1e3:.2f} ms a step) that backward "
            f"({model.compute.backward_fraction * step.compute_s * 1e3:.2f} ms) does not hide"
        )
    if cause == "sync":
        return (
            f"a synchronous step's own cost, {model.sync_overhead_s * 1e3:.2f} ms a step with "
            "more than one worker (sync_overhead_s: waiting for the slowest, the gradient "
            "hooks, the collective's wait loop)"
        )
    if cause == "batchnorm":
        return (
            f"sync_batchnorm's reductions, 2 per BatchNorm layer ({len(model.batchnorm_channels)}) "
            f"and micro-batch, {step.batchnorm_s * 1e3:.2f} ms a step over "
            f"{topo.nodes(replicas)} node(s) (batchnorm_channels)"
        )
    if cause == "overhead":
        return "the engine's per-window cost, shared by fewer steps per window"
    if cause == "data":
        return "waiting on the input pipeline, which the compute no longer hides"
    if cause == "uneven split":
        return "the global batch does not split evenly: the largest share sets the step"
    return (
        f"{len(row.phases)} phase start(s) at {model.phase_overhead_s * 1e3:.1f} ms each "
        "(phase_overhead_s: re-planning, regrouping, the one-step calibration windows)"
    )


def duration(seconds: float) -> str:
    """``42 s``, ``12.3 min``, ``5.2 h``, ``3.1 d``."""
    if not math.isfinite(seconds):
        return str(seconds)
    if abs(seconds) < 1:
        return f"{seconds * 1e3:.0f} ms"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if abs(seconds) >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _epoch(value: float) -> str:
    return f"{value:g}" if value == int(value) else f"{value:.1f}"


def _workers(count: int) -> str:
    return f"{count} worker" + ("s" if count != 1 else "")


__all__ = [
    "EFFICIENT",
    "PhaseRow",
    "TrainRow",
    "duration",
    "explain",
    "format_table",
    "losses",
    "schedule_rows",
    "time_to_train",
    "weak_rows",
]
