"""The data behind the training report: the fields each plot reads, and the numbers
derived from a history (wall time of each step, the per-step time split into ``TERMS``).

Pure functions of a ``History``'s records, no matplotlib: ``dataflow.history.report`` explains the
time split and writes the files; ``dataflow.history.report_plots`` draws the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dataflow.core.window import PEER_WAIT
from dataflow.history.records import EpochRecord, PhaseRecord, StepRecord
from dataflow.history.result import History

# The fields each plot reads: the trainer must write them (tests/test_report.py).
# What the report needs: the records' required fields (one schema, dataflow.history.records).
REPORT_FIELDS: dict[str, tuple[str, ...]] = {
    "steps": StepRecord.required(),
    "epochs": EpochRecord.required(),
    "phases": PhaseRecord.required(),
    "info": ("run_id", "replicas", "epochs", "stages", "train_seconds"),
}
# Shown when present (newer trainers, Adaptive schedules, evaluation): never required.
OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "epochs": ("eval_loss",),  # and every other ``eval_<metric>``
    "phases": ("micro_batches", "noise_scale", "measured_noise_scale", "gain", "task_seconds"),
    "info": ("stage_kinds", "workers"),
}

TERMS = ("data wait", "compute", "evaluation", "exposed allreduce", "engine overhead")
TERM_COLORS = {
    "data wait": "#e6a23c",
    "compute": "#3a7bd5",
    "evaluation": "#9b8ec4",
    "exposed allreduce": "#d64545",
    "engine overhead": "#8c8c8c",
}
STEP_TIME_CAPTION = (
    "Each bar is one replica in one phase: the phase's wall time per training step, split "
    "into data wait (time in Load: the step waited for its batch), compute (Forward, Backward, "
    "Update and other stages doing this replica's own work), evaluation (Evaluate, spread over "
    "the phase's steps), exposed allreduce (time in AllReduce: gradient averaging not hidden "
    "behind backward, including waiting for slower replicas) and engine overhead (the rest of "
    "the phase's wall time: Dask scheduling, task dispatch, phase start and end)."
)


def missing_fields(history: History) -> list[str]:
    """``REPORT_FIELDS`` absent from ``history``, as ``"phases[1].stage_seconds"``."""
    missing = []
    for section in ("steps", "epochs", "phases"):
        for i, row in enumerate(getattr(history, section)):
            missing += [f"{section}[{i}].{k}" for k in REPORT_FIELDS[section] if k not in row]
    missing += [f"info.{k}" for k in REPORT_FIELDS["info"] if k not in history.info]
    return missing


def as_number(value: Any) -> float:
    """A JSON value as a float: NaN for None, strings like "nan" and missing values."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def step_wall_times(steps: Sequence[dict[str, Any]]) -> np.ndarray:
    """Seconds since training start at the end of each step.

    The driver stamps ``time`` when a window's results arrive, so the steps of one
    window share (almost) one stamp; each is moved back by the durations of the
    steps after it in that window, never before the previous window's end.
    """
    stamps = np.array([as_number(s.get("time")) for s in steps], dtype=float)
    seconds = np.array([max(as_number(s.get("seconds")), 0.0) for s in steps], dtype=float)
    seconds = np.nan_to_num(seconds)
    out = stamps.copy()
    start = 0
    while start < len(steps):
        stop = start + 1
        while stop < len(steps) and stamps[stop] - stamps[stop - 1] < 0.5 * seconds[stop]:
            stop += 1
        floor = out[start - 1] if start > 0 else 0.0
        after = np.concatenate([np.cumsum(seconds[start + 1 : stop][::-1])[::-1], [0.0]])
        out[start:stop] = np.maximum(stamps[stop - 1] - after, floor)
        start = stop
    return out


def throughput(history: History, phase: int | None = None) -> tuple[float, float]:
    """The samples the fit's committed steps trained and the seconds they took on the
    fit's training clock: of the whole fit (``phase=None``: ``info["train_seconds"]``) or
    of the phase numbered ``phase``. A phase runs from the previous phase's last step (0
    for the first) to its own last step, the last one to the fit's end, so the phases'
    seconds add up to the fit's and a one-phase fit's samples/s is the fit's. Every
    whole-job samples/s in the report (its title, ``replicas.png``) is this one figure;
    a history without step times falls back to the phase's own ``seconds``."""
    steps = history.steps
    times = step_wall_times(steps)
    finite = times[np.isfinite(times)]
    total = as_number(history.info.get("train_seconds"))
    if not (math.isfinite(total) and total > 0):
        total = float(finite.max()) if finite.size else math.nan
    if phase is None:
        return float(sum(np.nan_to_num(as_number(s.get("samples"))) for s in steps)), total
    mine = [k for k, s in enumerate(steps) if s.get("phase") == phase]
    samples = float(sum(np.nan_to_num(as_number(steps[k].get("samples"))) for k in mine))
    record = next((p for p in history.phases if p.get("phase") == phase), {})
    if not mine:
        return samples, as_number(record.get("seconds"))
    start = float(times[mine[0] - 1]) if mine[0] > 0 else 0.0
    end = total if mine[-1] == len(steps) - 1 else float(times[mine[-1]])
    seconds = end - start
    return samples, seconds if seconds > 0 else as_number(record.get("seconds"))


def stage_kind(name: str, info: dict[str, Any]) -> str:
    """A stage's term in the time split: from ``info["stage_kinds"]`` (the stage's class
    name) when the trainer recorded it, else from its name (graphs name stages by class)."""
    kind = str(info.get("stage_kinds", {}).get(name, name)).lower()
    if kind.startswith("load"):
        return "data wait"
    if kind.startswith("allreduce") or kind.startswith("all_reduce") or kind == PEER_WAIT:
        return "exposed allreduce"  # (PEER_WAIT: sync_batchnorm's reductions' waits)
    if kind.startswith("evaluate"):
        return "evaluation"
    return "compute"


def step_time_split(phase: dict[str, Any], info: dict[str, Any]) -> list[dict[str, float]]:
    """Per replica, seconds per step in each of ``TERMS`` (see the module docstring)."""
    steps = max(int(phase.get("steps") or 0), 1)
    wall = as_number(phase.get("seconds"))
    split = []
    for stages in phase.get("stage_seconds") or []:
        terms = dict.fromkeys(TERMS, 0.0)
        for name, seconds in stages.items():
            terms[stage_kind(name, info)] += as_number(seconds) / steps
        in_stages = sum(terms.values())
        terms["engine overhead"] = max(wall / steps - in_stages, 0.0) if math.isfinite(wall) else 0
        split.append(terms)
    return split


def eval_metric_names(epochs: Sequence[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for row in epochs:
        names += [k for k in row if k.startswith("eval_") and k not in names]
    return sorted(names, key=lambda k: (k != "eval_loss", k))


def _epoch_ends(history: History, samples_seen: np.ndarray, times: np.ndarray) -> dict:
    """Samples seen and wall time at the end of each epoch, from its last step."""
    ends: dict[int, tuple[float, float]] = {}
    for i, step in enumerate(history.steps):
        ends[int(step.get("epoch", -1))] = (float(samples_seen[i]), float(times[i]))
    return ends


def sync_table(history: History) -> list[str]:
    """Markdown lines: per phase and replica, the samples trained, the waits lockstep
    steps would have had, and (asynchronous updates) the pushes and their staleness.
    Empty when no phase recorded any of these (synchronous training)."""
    rows = []
    for phase in history.phases:
        waits = phase.get("lockstep_wait_s")
        counts = phase.get("staleness_counts")
        if waits is None and counts is None:
            continue
        replicas = len(phase["local_batches"])
        samples = phase.get("samples_trained") or [None] * replicas
        for r in range(replicas):
            mine = counts[r] if counts is not None and r < len(counts) else []
            spread = ", ".join(f"{tau}: {n}" for tau, n in enumerate(mine) if n) or "-"
            wait = f"{waits[r]:.2f}" if waits is not None and r < len(waits) else "-"
            trained = samples[r] if samples[r] is not None else "-"
            rows.append(
                f"| {phase['phase']} | {r} | {trained} | {sum(mine) if mine else '-'} | "
                f"{spread} | {wait} |"
            )
        for lost in phase.get("lost_replicas") or ():  # lost in the phase: up to the loss
            rows.append(
                f"| {phase['phase']} | lost ({lost['worker']}) | {lost['samples']} | - | - | - |"
            )
    if not rows:
        return []
    info = history.info.get("sync", "")
    return [
        "## Keeping replicas in step",
        "",
        f"{info}." if info else "",
        "",
        "| phase | replica | samples trained | pushes | pushes by staleness (versions: "
        "count) | lockstep wait s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Lockstep wait: the seconds synchronous steps would have made the replica wait for "
        "the slowest, from every step's measured work.",
        "",
    ]
