"""The training report's figures (matplotlib): ``plot_training``, ``plot_schedule``,
``plot_replicas`` and ``plot_step_time``, each ``(history, path, plt) -> path``.

``dataflow.history.report.write_report`` picks the plots a history has the fields for and passes
``plt`` (matplotlib.pyplot on the Agg backend); what each plot shows: its docstring and caption.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from dataflow.history.report_data import (
    STEP_TIME_CAPTION,
    TERM_COLORS,
    TERMS,
    _epoch_ends,
    as_number,
    eval_metric_names,
    step_time_split,
    step_wall_times,
    throughput,
)
from dataflow.history.result import History, epochs_trained


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


def _resume_seams(history: History, x: np.ndarray) -> list[float]:
    """Along ``x`` (one value per step): where each resumed run took over (the end of
    the step before its first; ``info["segments"]``)."""
    position = {s.get("step"): i for i, s in enumerate(history.steps)}
    starts = [seg.get("start_step", 0) for seg in (history.info.get("segments") or [])[1:]]
    return [float(x[position[start - 1]]) for start in starts if start - 1 in position]


def _running_mean(values: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(values) < window:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def report_title(history: History) -> str:
    info = history.info
    samples, seconds = throughput(history)
    parts = [f"run {info.get('run_id', '?')}", f"{info.get('replicas', '?')} replica(s)"]
    asked = info.get("epochs", len(history.epochs))
    parts += [epochs_trained(history, asked), f"{samples:,.0f} samples"]
    runs = len(info.get("segments") or ())
    if math.isfinite(seconds) and seconds > 0:  # every run's, when resumed
        over = f" over {runs} runs" if runs > 1 else ""
        parts.append(f"{seconds:.1f} s training{over} ({samples / seconds:,.0f} samples/s)")
    return "  ·  ".join(parts)


def _finish(fig: Any, plt: Any, history: History, path: Path, caption: str = "") -> Path:
    """Title with the run's summary, the caption wrapped under the plots, saved as PNG."""
    fig.suptitle(report_title(history), fontsize=10)
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
    samples = np.array([as_number(s.get("samples")) for s in history.steps])
    seen = np.cumsum(np.nan_to_num(samples))
    times = step_wall_times(history.steps)
    loss = np.array([as_number(s.get("loss")) for s in history.steps])
    ends = _epoch_ends(history, seen, times)
    metrics = [m for m in eval_metric_names(history.epochs) if m != "eval_loss"]
    rows = 1 + len(metrics)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.9 * rows + 0.6), squeeze=False, sharex="col")
    window = max(1, len(loss) // 40)
    xs = [
        (seen, 0, "samples seen (training samples, all replicas)"),
        (times, 1, "wall time since training start (s)"),
    ]
    for x, col, xlabel in xs:
        bounds = _phase_bounds(history, x)
        for seam_row, seam in itertools.product(axes[:, col], _resume_seams(history, x)):
            seam_row.axvline(seam, color="#8e44ad", ls="--", lw=1.2, zorder=1)
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
            [as_number(e.get("train_loss")) for e in rows_in],
            "o",
            color="#1f3f73",
            ms=5,
            label="train loss, mean over the epoch (at its end)",
        )
        if any("eval_loss" in e for e in rows_in):
            ax.plot(
                epoch_x,
                [as_number(e.get("eval_loss")) for e in rows_in],
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
                [as_number(e.get(metric)) for e in rows_in],
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
        kept = (history.info.get("best") or {}).get("epoch")
        if kept in ends:  # keep_best: where the kept weights were taken
            for r, row in enumerate(axes[:, col]):
                label = "the kept weights (keep_best)" if r == 0 else None
                row.axvline(ends[kept][col], color="#e9a400", ls=":", lw=1.8, label=label)
        if bounds:  # from the training's start (0): the first phase's label stays in view,
            axes[0][col].set_xlim(left=bounds[0][0])  # else layout makes room for it outside
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
    if (history.info.get("best") or {}).get("epoch") in ends:
        caption += " Dotted gold line: the end of the epoch whose weights keep_best kept."
    if _resume_seams(history, seen):
        caption += (
            " Dashed purple lines: a run resumed from a checkpoint; wall time counts each run's "
            "training seconds back to back."
        )
    return _finish(fig, plt, history, path, caption)


def _phase_edges(history: History) -> tuple[list[float], list[float]]:
    """Epoch edges of the phases, for step plots: x (len n+1) and the phases' values."""
    starts = [as_number(p.get("start_epoch")) for p in history.phases]
    ends = [as_number(p.get("end_epoch")) for p in history.phases]
    return [*starts, ends[-1]], ends


def _step_plot(ax: Any, history: History, values: list[float], **style: Any) -> None:
    edges, _ = _phase_edges(history)
    ax.stairs(values, edges, baseline=None, lw=2, **style)


def lr_per_step(history: History) -> tuple[list[float], list[float]]:
    """Each step's LR against its progress in epochs (its epoch, plus the share of the
    epoch's samples trained before it); empty when the steps did not record one."""
    totals: dict[int, float] = {}
    for step in history.steps:
        epoch = int(as_number(step.get("epoch")))
        totals[epoch] = totals.get(epoch, 0.0) + (as_number(step.get("samples")) or 0.0)
    progress, lrs, seen = [], [], dict.fromkeys(totals, 0.0)
    for step in history.steps:
        epoch, lr = int(as_number(step.get("epoch"))), as_number(step.get("lr"))
        if math.isfinite(lr):
            progress.append(epoch + seen[epoch] / max(totals[epoch], 1.0))
            lrs.append(lr)
        seen[epoch] += as_number(step.get("samples")) or 0.0
    return progress, lrs


def plot_schedule(history: History, path: Path, plt: Any) -> Path:
    """Global batch and learning rate per phase (and the noise scale and gain when the
    schedule measured them), against epochs."""
    phases = history.phases
    noise = [as_number(p.get("noise_scale")) for p in phases]
    measured = [as_number(p.get("measured_noise_scale")) for p in phases]
    gain = [as_number(p.get("gain")) for p in phases]
    has_gain = any(math.isfinite(g) for g in gain)
    rows = 3 if has_gain else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.9 * rows + 0.4), sharex=True)
    edges, _ = _phase_edges(history)
    batch = [as_number(p.get("global_batch")) for p in phases]
    ax = axes[0]
    _step_plot(ax, history, batch, color="#3a7bd5", label="global batch B (all replicas)")
    for p, b in zip(phases, batch, strict=True):
        middle = (as_number(p.get("start_epoch")) + as_number(p.get("end_epoch"))) / 2
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
    progress, step_lr = lr_per_step(history)
    if step_lr:  # each step's own (ramps and the fit's decay)
        ax.plot(progress, step_lr, color="#2a9d5b", lw=1.5, label="learning rate of each step")
        ax.set_title("Learning rate")
    else:  # an older history: the phases' only
        lr = [as_number(p.get("lr")) for p in phases]
        _step_plot(ax, history, lr, color="#2a9d5b", label="learning rate at the end of the phase")
        ax.set_title("Learning rate per phase")
    ax.set_ylabel("learning rate")
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
    fig, caption = replicas_figure(history, plt)
    return _finish(fig, plt, history, path, caption)


def replicas_figure(history: History, plt: Any) -> tuple[Any, str]:
    """``plot_replicas``'s figure, unsaved, and its caption. One legend, beside
    the left panel (the colours are the same in both): inside the right panel it hid
    the bars."""
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
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="both panels")
    ax = axes[1]
    width = 0.8 / max(count, 1)
    for r in range(count):
        rates = [_rate_of(p, r) for p in phases]
        offset = (r - (count - 1) / 2) * width
        ax.bar(x + offset, rates, width, color=colors(r % 10), label=labels[r])
    for k, phase in enumerate(phases):
        samples, seconds = throughput(history, phase.get("phase"))  # as the title's
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
    ax.margins(y=0.15)
    caption = (
        "Left: how each phase's global batch B was split (the balancer gives faster replicas "
        'more; "k× micro": that replica accumulated its gradient over k micro-batches). '
        "Right: each replica's samples per second of its own compute (excluding waits on data "
        "and peers); above the bars, the whole job's end-to-end samples/s in the phase (the "
        "samples its steps trained over its share of the training time; the title's figure "
        "is the same for the whole fit)."
    )
    return fig, caption


def _batch_of(phase: dict[str, Any], rank: int) -> float:
    local = phase.get("local_batches") or []
    return as_number(local[rank]) if rank < len(local) else 0.0


def _micro_of(phase: dict[str, Any], rank: int) -> int:
    micro = phase.get("micro_batches") or []
    return int(as_number(micro[rank])) if rank < len(micro) and micro[rank] else 1


def _rate_of(phase: dict[str, Any], rank: int) -> float:
    rates = phase.get("samples_per_second") or []
    return as_number(rates[rank]) if rank < len(rates) else 0.0


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
            batches.append(max(as_number(phase.get("global_batch")), 1.0))
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
