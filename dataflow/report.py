"""The training report: PNG plots, CSV tables and the history JSON of one fit.

``write_report(history, out_dir)`` reads only the fields listed in
``REPORT_FIELDS`` (and, when present, ``OPTIONAL_FIELDS``), so a test can hold
the trainer's records to what the plots need. Histories from older versions
that lack a field get the plots they can have; the others are listed as skipped
in ``report.md``.

The per-step time split (``step_time.png``) divides each phase's wall time
into terms, per replica, per step (a term's seconds over the phase / its steps):

- **data wait**: time in ``Load`` stages: the step blocked for its batch
  (prefetch hides the rest of reading and decoding);
- **compute**: time in every other stage that runs this replica's own work
  (Transform, Forward, Backward, Update, custom stages; a simulated slow
  node's extra sleep counts here too);
- **evaluation**: time in ``Evaluate`` stages, spread over the phase's steps;
- **exposed allreduce**: time in ``AllReduce`` stages: the part of gradient
  averaging not hidden behind backward, including waiting for slower replicas;
- **engine overhead**: the phase's wall time (on the driver) minus all the
  above: Dask scheduling and task dispatch, per-step hooks, the phase's
  calibration, start and end, gathering results.

So each bar adds up to the phase's wall time divided by its steps.
"""

from __future__ import annotations

import csv
import importlib.util
import itertools
import math
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dataflow.errors import DataflowError
from dataflow.history import History

# The fields each plot reads: the trainer must write them (tests/test_report.py).
REPORT_FIELDS: dict[str, tuple[str, ...]] = {
    "steps": ("step", "phase", "epoch", "loss", "samples", "seconds", "time"),
    "epochs": ("epoch", "train_loss"),
    "phases": (
        "phase",
        "start_epoch",
        "end_epoch",
        "global_batch",
        "lr",
        "local_batches",
        "samples_per_second",
        "steps",
        "seconds",
        "stage_seconds",
    ),
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


class ReportError(DataflowError, ValueError):
    """The history cannot be read or lacks what every plot needs."""


class MissingDependencyError(DataflowError, ImportError):
    """An optional package the command needs is not installed (names the pip package)."""


def missing_fields(history: History) -> list[str]:
    """``REPORT_FIELDS`` absent from ``history``, as ``"phases[1].stage_seconds"``."""
    missing = []
    for section in ("steps", "epochs", "phases"):
        for i, row in enumerate(getattr(history, section)):
            missing += [f"{section}[{i}].{k}" for k in REPORT_FIELDS[section] if k not in row]
    missing += [f"info.{k}" for k in REPORT_FIELDS["info"] if k not in history.info]
    return missing


def load_history(history_or_path: History | str | Path) -> History:
    if isinstance(history_or_path, History):
        return history_or_path
    path = Path(history_or_path)
    if not path.is_file():
        raise ReportError(
            f"no history file at {str(path)!r}; pass the history.json a fit wrote "
            "(FitResult.history.to_json(path), or runs/demo/history.json after `dataflow demo`)"
        )
    try:
        return History.from_json(path)
    except (ValueError, TypeError) as exc:
        raise ReportError(
            f"{str(path)!r} is not a dataflow history JSON ({exc}); pass the file written by "
            "History.to_json"
        ) from exc


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(
            "the training report needs matplotlib: pip install matplotlib"
        ) from exc
    matplotlib.use("Agg", force=True)  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------- data


def _number(value: Any) -> float:
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
    stamps = np.array([_number(s.get("time")) for s in steps], dtype=float)
    seconds = np.array([max(_number(s.get("seconds")), 0.0) for s in steps], dtype=float)
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


def stage_kind(name: str, info: dict[str, Any]) -> str:
    """A stage's term in the time split: from ``info["stage_kinds"]`` (the stage's class
    name) when the trainer recorded it, else from its name (graphs name stages by class)."""
    kind = str(info.get("stage_kinds", {}).get(name, name)).lower()
    if kind.startswith("load"):
        return "data wait"
    if kind.startswith("allreduce") or kind.startswith("all_reduce"):
        return "exposed allreduce"
    if kind.startswith("evaluate"):
        return "evaluation"
    return "compute"


def step_time_split(phase: dict[str, Any], info: dict[str, Any]) -> list[dict[str, float]]:
    """Per replica, seconds per step in each of ``TERMS`` (see the module docstring)."""
    steps = max(int(phase.get("steps") or 0), 1)
    wall = _number(phase.get("seconds"))
    split = []
    for stages in phase.get("stage_seconds") or []:
        terms = dict.fromkeys(TERMS, 0.0)
        for name, seconds in stages.items():
            terms[stage_kind(name, info)] += _number(seconds) / steps
        in_stages = sum(terms.values())
        terms["engine overhead"] = max(wall / steps - in_stages, 0.0) if math.isfinite(wall) else 0
        split.append(terms)
    return split


def _eval_metrics(epochs: Sequence[dict[str, Any]]) -> list[str]:
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


# --------------------------------------------------------------------------- plots


def _phase_bounds(history: History, x: np.ndarray) -> list[tuple[float, float, str]]:
    """(start, stop, label) of each phase along ``x`` (one value per step)."""
    batch = {p.get("phase"): p.get("global_batch") for p in history.phases}
    bounds: list[tuple[float, float, str]] = []
    previous_end = 0.0
    for i, step in enumerate(history.steps):
        phase = step.get("phase")
        if not bounds or bounds[-1][2] != phase:
            bounds.append([previous_end, float(x[i]), phase])  # type: ignore[arg-type]
        bounds[-1][1] = float(x[i])  # type: ignore[index]
        previous_end = float(x[i])
    return [(a, b, f"phase {p}\nB={batch.get(p, '?')}") for a, b, p in bounds]


def _shade_phases(ax: Any, bounds: list[tuple[float, float, str]], label: bool) -> None:
    for k, (start, stop, text) in enumerate(bounds):
        if k % 2:
            ax.axvspan(start, stop, color="0.93", zorder=0, lw=0)
        if k:
            ax.axvline(start, color="0.45", ls=":", lw=1, zorder=1)
        if label:
            ax.text(
                (start + stop) / 2,
                1.0,
                text,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=8,
                color="0.3",
            )


def _running_mean(values: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(values) < window:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def _title(history: History) -> str:
    info = history.info
    samples = sum(int(_number(s.get("samples")) or 0) for s in history.steps)
    seconds = _number(info.get("train_seconds"))
    parts = [f"run {info.get('run_id', '?')}", f"{info.get('replicas', '?')} replica(s)"]
    parts += [f"{info.get('epochs', len(history.epochs))} epoch(s)", f"{samples:,} samples"]
    if math.isfinite(seconds) and seconds > 0:
        parts.append(f"{seconds:.1f} s training ({samples / seconds:,.0f} samples/s)")
    return "  ·  ".join(parts)


def _finish(fig: Any, plt: Any, history: History, path: Path, caption: str = "") -> Path:
    """Title with the run's summary, the caption wrapped under the plots, saved as PNG."""
    fig.suptitle(_title(history), fontsize=10)
    lines = textwrap.wrap(caption, width=int(fig.get_figwidth() * 15)) if caption else []
    if lines:
        fig.text(0.01, 0.01, "\n".join(lines), ha="left", va="bottom", fontsize=8, color="0.3")
    bottom = (len(lines) * 0.16 + 0.1) / fig.get_figheight() if lines else 0
    top = 1 - 0.35 / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training(history: History, path: Path, plt: Any) -> Path:
    """Loss and each evaluation metric against samples seen (left) and wall time (right)."""
    samples = np.array([_number(s.get("samples")) for s in history.steps])
    seen = np.cumsum(np.nan_to_num(samples))
    times = step_wall_times(history.steps)
    loss = np.array([_number(s.get("loss")) for s in history.steps])
    ends = _epoch_ends(history, seen, times)
    metrics = [m for m in _eval_metrics(history.epochs) if m != "eval_loss"]
    rows = 1 + len(metrics)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.9 * rows + 0.6), squeeze=False, sharex="col")
    window = max(1, len(loss) // 40)
    xs = [
        (seen, 0, "samples seen (training samples, all replicas)"),
        (times, 1, "wall time since training start (s)"),
    ]
    for x, col, xlabel in xs:
        bounds = _phase_bounds(history, x)
        ax = axes[0][col]
        _shade_phases(ax, bounds, label=True)
        ax.plot(x, loss, color="#3a7bd5", alpha=0.25, lw=0.8, label="train loss, each step")
        if window > 1:
            ax.plot(
                x,
                _running_mean(loss, window),
                color="#3a7bd5",
                lw=1.8,
                label=f"train loss, mean of last {window} steps",
            )
        epoch_x = [ends[e["epoch"]][col] for e in history.epochs if e.get("epoch") in ends]
        rows_in = [e for e in history.epochs if e.get("epoch") in ends]
        ax.plot(
            epoch_x,
            [_number(e.get("train_loss")) for e in rows_in],
            "o",
            color="#1f3f73",
            ms=5,
            label="train loss, mean over the epoch (at its end)",
        )
        if any("eval_loss" in e for e in rows_in):
            ax.plot(
                epoch_x,
                [_number(e.get("eval_loss")) for e in rows_in],
                "s--",
                color="#d64545",
                ms=5,
                lw=1,
                label="held-out loss, end of epoch",
            )
        if np.nanmin(loss, initial=np.inf) > 0 and np.nanmax(loss) / np.nanmin(loss) > 30:
            ax.set_yscale("log")
        ax.set_ylabel("loss")
        if rows == 1:
            ax.set_xlabel(xlabel)
        ax.set_title(f"Loss vs {'samples seen' if col == 0 else 'wall time'}", pad=26)
        ax.grid(alpha=0.3)
        for r, metric in enumerate(metrics, start=1):
            ax = axes[r][col]
            _shade_phases(ax, bounds, label=False)
            name = metric.removeprefix("eval_")
            ax.plot(
                epoch_x,
                [_number(e.get(metric)) for e in rows_in],
                "s-",
                color="#2a9d5b",
                ms=5,
                label=f"held-out {name}, end of epoch",
            )
            ax.set_ylabel(name)
            if r == rows - 1:
                ax.set_xlabel(xlabel)
            ax.set_title(f"Held-out {name} vs {'samples seen' if col == 0 else 'wall time'}")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="upper center",
        ncol=len(labels),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 1 - 0.3 / fig.get_figheight()),
    )
    caption = (
        "Shaded bands and dotted lines: phases (a phase keeps one global batch B and one "
        "learning rate). Wall time per step is reconstructed from step durations (results "
        "arrive one window of steps at a time)."
    )
    return _finish(fig, plt, history, path, caption)


def _phase_edges(history: History) -> tuple[list[float], list[float]]:
    """Epoch edges of the phases, for step plots: x (len n+1) and the phases' values."""
    starts = [_number(p.get("start_epoch")) for p in history.phases]
    ends = [_number(p.get("end_epoch")) for p in history.phases]
    return [*starts, ends[-1]], ends


def _step_plot(ax: Any, history: History, values: list[float], **style: Any) -> None:
    edges, _ = _phase_edges(history)
    ax.stairs(values, edges, baseline=None, lw=2, **style)


def plot_schedule(history: History, path: Path, plt: Any) -> Path:
    """Global batch and learning rate per phase (and the noise scale and gain when the
    schedule measured them), against epochs."""
    phases = history.phases
    noise = [_number(p.get("noise_scale")) for p in phases]
    measured = [_number(p.get("measured_noise_scale")) for p in phases]
    gain = [_number(p.get("gain")) for p in phases]
    has_gain = any(math.isfinite(g) for g in gain)
    rows = 3 if has_gain else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.9 * rows + 0.4), sharex=True)
    edges, _ = _phase_edges(history)
    batch = [_number(p.get("global_batch")) for p in phases]
    ax = axes[0]
    _step_plot(ax, history, batch, color="#3a7bd5", label="global batch B (all replicas)")
    for p, b in zip(phases, batch, strict=True):
        middle = (_number(p.get("start_epoch")) + _number(p.get("end_epoch"))) / 2
        steps = p.get("steps", "?")
        ax.annotate(
            f"B={b:g}\n{steps} steps",
            (middle, b),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    if any(math.isfinite(v) for v in noise):
        ax.plot(mids, noise, "D", color="#e6a23c", label="noise scale the phase was chosen from")
    if any(math.isfinite(v) for v in measured):
        ends = edges[1:]
        label = "noise scale measured in the phase (at its end)"
        ax.plot(ends, measured, "x", color="#d64545", ms=8, label=label)
    finite = [v for v in [*batch, *noise, *measured] if math.isfinite(v) and v > 0]
    if finite and max(finite) / min(finite) > 8:
        ax.set_yscale("log", base=2)
    ax.set_ylabel("samples per step")
    ax.set_title("Global batch size per phase")
    ax.margins(y=0.25)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    lr = [_number(p.get("lr")) for p in phases]
    _step_plot(ax, history, lr, color="#2a9d5b", label="learning rate at the end of the phase")
    ax.set_ylabel("learning rate")
    ax.set_title("Learning rate per phase")
    ax.margins(y=0.2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    if has_gain:
        ax = axes[2]
        _step_plot(ax, history, gain, color="#9b8ec4", label="LR gain applied (AdaScale)")
        ax.axhline(1.0, color="0.5", ls=":", lw=1)
        ax.set_ylabel("gain (×)")
        ax.set_title("Learning-rate gain per phase (1 = no gain; B/B0 = linear scaling)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    for ax in axes:
        for edge in edges[1:-1]:
            ax.axvline(edge, color="0.45", ls=":", lw=1)
    axes[-1].set_xlabel("epoch")
    axes[-1].set_xticks(sorted({*edges, *range(int(edges[0]), int(edges[-1]) + 1)}))
    return _finish(fig, plt, history, path)


def _replica_labels(history: History, count: int) -> list[str]:
    workers = {w.get("rank"): w for w in history.info.get("workers") or [] if isinstance(w, dict)}
    labels = []
    for r in range(count):
        device = workers.get(r, {}).get("device")
        labels.append(f"replica {r}" + (f" ({device})" if device else ""))
    return labels


def plot_replicas(history: History, path: Path, plt: Any) -> Path:
    """Per phase: each replica's share of the global batch, and its samples/s."""
    phases = history.phases
    count = max(len(p.get("local_batches") or []) for p in phases)
    labels = _replica_labels(history, count)
    colors = plt.get_cmap("tab10")
    names = [f"phase {p.get('phase')}\nB={p.get('global_batch')}" for p in phases]
    x = np.arange(len(phases))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    bottom = np.zeros(len(phases))
    for r in range(count):
        local = np.array([_batch_of(p, r) for p in phases], dtype=float)
        total = np.array([sum(p.get("local_batches") or [0]) or 1 for p in phases], dtype=float)
        share = 100 * local / total
        bars = ax.bar(x, share, 0.6, bottom=bottom, color=colors(r % 10), label=labels[r])
        for k, bar in enumerate(bars):
            if share[k] >= 6:
                micro = _micro_of(phases[k], r)
                text = f"{local[k]:g}" + (f"\n{micro}× micro" if micro > 1 else "")
                ax.text(
                    bar.get_x() + bar.get_width() / 2,
                    bottom[k] + share[k] / 2,
                    text,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
        bottom += share
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("share of the global batch (%)")
    ax.set_title("Batch split across replicas (numbers: local batch, samples)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax = axes[1]
    width = 0.8 / max(count, 1)
    for r in range(count):
        rates = [_rate_of(p, r) for p in phases]
        offset = (r - (count - 1) / 2) * width
        ax.bar(x + offset, rates, width, color=colors(r % 10), label=labels[r])
    for k, phase in enumerate(phases):
        samples = int(_number(phase.get("global_batch")) * _number(phase.get("steps")))
        seconds = _number(phase.get("seconds"))
        if seconds > 0:
            ax.text(
                x[k],
                1.0,
                f"whole job\n{samples / seconds:,.0f}/s",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=8,
                color="0.3",
            )
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("samples / s of compute time")
    ax.set_title("Speed of each replica (samples over time in compute stages)", pad=26)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.margins(y=0.15)
    caption = (
        "Left: how each phase's global batch B was split (the balancer gives faster replicas "
        'more; "k× micro": that replica accumulated its gradient over k micro-batches). '
        "Right: each replica's samples per second of its own compute (excluding waits on data "
        "and peers); above the bars, the whole job's end-to-end samples/s in the phase."
    )
    return _finish(fig, plt, history, path, caption)


def _batch_of(phase: dict[str, Any], rank: int) -> float:
    local = phase.get("local_batches") or []
    return _number(local[rank]) if rank < len(local) else 0.0


def _micro_of(phase: dict[str, Any], rank: int) -> int:
    micro = phase.get("micro_batches") or []
    return int(_number(micro[rank])) if rank < len(micro) and micro[rank] else 1


def _rate_of(phase: dict[str, Any], rank: int) -> float:
    rates = phase.get("samples_per_second") or []
    return _number(rates[rank]) if rank < len(rates) else 0.0


def _time_unit(longest: float) -> tuple[float, str]:
    if longest >= 1:
        return 1.0, "s"
    return (1e3, "ms") if longest >= 1e-3 else (1e6, "µs")


def plot_step_time(history: History, path: Path, plt: Any) -> Path:
    """Stacked bars: each replica's wall time per step in each phase, split into ``TERMS``;
    right, the same divided by the global batch (time per training sample)."""
    splits = [step_time_split(p, history.info) for p in history.phases]
    used = [t for t in TERMS if any(s[t] > 0 for split in splits for s in split)]
    positions, tick_labels, groups, batches = [], [], [], []
    pos = 0.0
    for phase, split in zip(history.phases, splits, strict=True):
        first = pos
        for r in range(len(split)):
            positions.append(pos)
            tick_labels.append(f"r{r}")
            batches.append(max(_number(phase.get("global_batch")), 1.0))
            pos += 1
        groups.append(((first + pos - 1) / 2, phase))
        pos += 0.8
    flat = [s for split in splits for s in split]
    width = max(6.0, 0.5 * len(positions) + 3)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width + 2, 5.6))
    panels = [
        (axes[0], np.ones(len(flat)), "wall time per step", "Time per training step"),
        (
            axes[1],
            np.array(batches),
            "time per sample",
            "Time per sample (per step ÷ B)",
        ),
    ]
    for ax, divide, ylabel, title in panels:
        totals = np.array([sum(s.values()) for s in flat]) / divide
        scale, unit = _time_unit(float(totals.max(initial=0.0)))
        bottom = np.zeros(len(flat))
        for term in used:
            values = np.array([s[term] for s in flat]) / divide * scale
            ax.bar(positions, values, 0.75, bottom=bottom, color=TERM_COLORS[term], label=term)
            bottom += values
        for x, top in zip(positions, bottom, strict=True):
            ax.text(x, top, f"{top:.3g}", ha="center", va="bottom", fontsize=7, color="0.3")
        ax.set_xticks(positions, tick_labels, fontsize=8)
        for middle, phase in groups:
            ax.text(
                middle,
                -0.09,
                f"phase {phase.get('phase')}\n(B={phase.get('global_batch')})",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=8,
            )
        ax.set_ylabel(f"{ylabel} ({unit})")
        ax.set_title(f"{title}, per replica (r0, r1, …) and phase")
        ax.margins(y=0.1)
        ax.grid(axis="y", alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="term")
    return _finish(fig, plt, history, path, STEP_TIME_CAPTION)


# --------------------------------------------------------------------------- tables


def write_steps_csv(history: History, path: Path) -> Path:
    """One row per step, with the samples seen, reconstructed wall time, batch and LR."""
    phases = {p.get("phase"): p for p in history.phases}
    times = step_wall_times(history.steps)
    seen = 0
    columns = ["step", "phase", "epoch", "loss", "samples", "samples_seen", "seconds"]
    columns += ["time", "wall_time", "global_batch", "lr"]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for step, wall in zip(history.steps, times, strict=True):
            seen += int(_number(step.get("samples")) or 0)
            phase = phases.get(step.get("phase"), {})
            row = {**step, "samples_seen": seen, "wall_time": round(float(wall), 6)}
            row.update(global_batch=phase.get("global_batch"), lr=phase.get("lr"))
            writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return path


def write_epochs_csv(history: History, path: Path) -> Path:
    columns = ["epoch", "train_loss", *_eval_metrics(history.epochs)]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in history.epochs:
            writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return path


# --------------------------------------------------------------------------- report

PLOTS = {
    "training.png": (
        plot_training,
        ("steps", "epochs"),
        "Training loss (each step, a running mean, and each epoch's mean) and the held-out "
        "metrics at the end of each epoch, against samples seen (left) and wall time (right). "
        "Shaded bands: phases.",
    ),
    "schedule.png": (
        plot_schedule,
        ("phases",),
        "The global batch size and learning rate of each phase against epochs; with an "
        "adaptive schedule, the gradient noise scale it measured and the LR gain it applied.",
    ),
    "replicas.png": (
        plot_replicas,
        ("phases",),
        "How each phase's global batch was split across replicas, and each replica's "
        "samples/s of compute time.",
    ),
    "step_time.png": (plot_step_time, ("phases",), STEP_TIME_CAPTION),
}


def _needs(history: History, sections: Iterable[str]) -> list[str]:
    missing = [m for m in missing_fields(history) if m.split("[")[0].split(".")[0] in sections]
    empty = [s for s in sections if not getattr(history, s)]
    return [f"no {s} recorded" for s in empty] + missing


def write_report(history_or_path: History | str | Path, out_dir: str | Path) -> list[Path]:
    """Write the report of one fit into ``out_dir``; returns the files written.

    ``training.png``, ``schedule.png``, ``replicas.png``, ``step_time.png`` (what
    each shows: ``report.md``), ``steps.csv`` and ``epochs.csv``, a copy of the
    history as ``history.json``, ``report.md`` (captions, and any plot skipped
    because an old history lacks its fields), and TensorBoard event files under
    ``tensorboard/`` when tensorboard is installed.
    """
    history = load_history(history_or_path)
    plt = _matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: list[str] = []
    for name, (plot, sections, caption) in PLOTS.items():
        lacking = _needs(history, sections)
        if lacking:
            notes.append(f"- {name} skipped: the history lacks {', '.join(lacking[:4])}")
            continue
        written.append(plot(history, out / name, plt))
        notes.append(f"![{name}]({name})\n\n{caption}\n")
    if history.steps:
        written.append(write_steps_csv(history, out / "steps.csv"))
    if history.epochs:
        written.append(write_epochs_csv(history, out / "epochs.csv"))
    target = out / "history.json"
    if not (isinstance(history_or_path, str | Path) and Path(history_or_path).resolve() == target):
        written.append(history.to_json(target))
    board = write_tensorboard(history, out / "tensorboard")
    if board is not None:
        written.append(board)
        notes.append("TensorBoard: `tensorboard --logdir tensorboard`\n")
    summary = [
        "# Training report",
        "",
        _title(history),
        "",
        *notes,
        "Tables: `steps.csv` (one row per step: loss, samples, samples_seen, seconds, "
        "wall_time, global_batch, lr), `epochs.csv` (one row per epoch), `history.json` "
        "(everything the fit recorded).",
        "",
    ]
    (out / "report.md").write_text("\n".join(summary))
    written.append(out / "report.md")
    return written


def write_tensorboard(history: History, logdir: str | Path) -> Path | None:
    """Write the history as TensorBoard scalars (x axis: samples seen); returns ``logdir``,
    or None when tensorboard is not installed (it is optional, never a dependency)."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    logdir = Path(logdir)
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        seen = 0
        epoch_seen: dict[int, int] = {}
        for step in history.steps:
            seen += int(_number(step.get("samples")) or 0)
            writer.add_scalar("train/loss", _number(step.get("loss")), seen)
            writer.add_scalar("train/step_seconds", _number(step.get("seconds")), seen)
            epoch_seen[int(step.get("epoch", -1))] = seen
        for row in history.epochs:
            at = epoch_seen.get(int(row.get("epoch", -1)), 0)
            for key, value in row.items():
                if key != "epoch" and math.isfinite(_number(value)):
                    writer.add_scalar(f"epoch/{key}", _number(value), at)
        for phase in history.phases:
            start = int(_number(phase.get("start_epoch")))
            at = epoch_seen.get(start - 1, 0)
            for key in ("global_batch", "lr", "noise_scale", "gain"):
                if math.isfinite(_number(phase.get(key))):
                    writer.add_scalar(f"phase/{key}", _number(phase.get(key)), at)
    finally:
        writer.close()
    return logdir
