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

This module holds the entry points (``load_history``, ``write_report``, the CSV tables and
TensorBoard); the figures are in ``dataflow.history.report_plots``, the numbers they plot in
``dataflow.history.report_data`` (both re-exported here).
"""

from __future__ import annotations

import csv
import importlib.util
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dataflow.core.errors import DataflowError
from dataflow.history.report_data import (
    OPTIONAL_FIELDS,
    REPORT_FIELDS,
    STEP_TIME_CAPTION,
    TERM_COLORS,
    TERMS,
    as_number,
    eval_metric_names,
    missing_fields,
    stage_kind,
    step_time_split,
    step_wall_times,
    sync_table,
)
from dataflow.history.report_plots import (
    plot_replicas,
    plot_schedule,
    plot_step_time,
    plot_training,
    report_title,
)
from dataflow.history.result import History, skipped_text

__all__ = [
    "OPTIONAL_FIELDS",
    "PLOTS",
    "REPORT_FIELDS",
    "STEP_TIME_CAPTION",
    "TERMS",
    "TERM_COLORS",
    "MissingDependencyError",
    "ReportError",
    "load_history",
    "missing_fields",
    "plot_replicas",
    "plot_schedule",
    "plot_step_time",
    "plot_training",
    "stage_kind",
    "step_time_split",
    "step_wall_times",
    "write_epochs_csv",
    "write_report",
    "write_steps_csv",
    "write_tensorboard",
]


class ReportError(DataflowError, ValueError):
    """The history cannot be read or lacks what every plot needs."""


class MissingDependencyError(DataflowError, ImportError):
    """An optional package the command needs is not installed (names the pip package)."""


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


# --------------------------------------------------------------------------- tables


def write_steps_csv(history: History, path: Path) -> Path:
    """One row per step, with the samples seen, reconstructed wall time, batch and LR,
    the gradient norm before clipping (``clip_grad_norm``), and ``skipped`` (True where
    the update was dropped as not finite)."""
    phases = {p.get("phase"): p for p in history.phases}
    times = step_wall_times(history.steps)
    seen = 0
    columns = ["step", "phase", "epoch", "loss", "samples", "samples_seen", "seconds"]
    columns += ["time", "wall_time", "global_batch", "lr", "grad_norm", "skipped"]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for step, wall in zip(history.steps, times, strict=True):
            seen += int(as_number(step.get("samples")) or 0)
            phase = phases.get(step.get("phase"), {})
            row = {**step, "samples_seen": seen, "wall_time": round(float(wall), 6)}
            lr = step.get("lr")  # the step's own; an older history's: its phase's
            row.update(
                global_batch=phase.get("global_batch"), lr=phase.get("lr") if lr is None else lr
            )
            writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return path


def write_epochs_csv(history: History, path: Path) -> Path:
    columns = ["epoch", "train_loss", *eval_metric_names(history.epochs)]
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
    skipped = skipped_text(history)
    summary = [
        "# Training report",
        "",
        report_title(history),
        "",
        *([f"{skipped[0].upper()}{skipped[1:]}.", ""] if skipped else []),
        *(
            [f"**Stopped early after epoch {stop['after_epoch']}**: {stop['reason']}.", ""]
            if (stop := history.info.get("stopped_early"))
            else []
        ),
        *(
            f"**Epoch {p['epoch']}'s evaluation scored {p['scored']} of {p['held_out']} "
            "held-out samples** (a lost worker took its share's scores with it).\n"
            for p in history.info.get("partial_evaluations") or ()
        ),
        *notes,
        *_kept_text(history),
        *sync_table(history),
        "Tables: `steps.csv` (one row per step: loss, samples, samples_seen, seconds, "
        "wall_time, global_batch, lr, skipped), `epochs.csv` (one row per epoch), `history.json` "
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
            seen += int(as_number(step.get("samples")) or 0)
            writer.add_scalar("train/loss", as_number(step.get("loss")), seen)
            writer.add_scalar("train/step_seconds", as_number(step.get("seconds")), seen)
            for key in ("lr", "grad_norm"):
                if step.get(key) is not None:
                    writer.add_scalar(f"train/{key}", as_number(step.get(key)), seen)
            epoch_seen[int(step.get("epoch", -1))] = seen
        for row in history.epochs:
            at = epoch_seen.get(int(row.get("epoch", -1)), 0)
            for key, value in row.items():
                if key != "epoch" and math.isfinite(as_number(value)):
                    writer.add_scalar(f"epoch/{key}", as_number(value), at)
        for phase in history.phases:
            start = int(as_number(phase.get("start_epoch")))
            at = epoch_seen.get(start - 1, 0)
            for key in ("global_batch", "lr", "noise_scale", "gain"):
                if math.isfinite(as_number(phase.get(key))):
                    writer.add_scalar(f"phase/{key}", as_number(phase.get(key)), at)
    finally:
        writer.close()
    return logdir


def _kept_text(history: History) -> list[str]:
    """``keep_best``: which epoch's weights the fit kept, and by what value."""
    best = history.info.get("best")
    if not best:
        return []
    where = f" in `{best['path']}`" if best.get("path") else ""
    return [
        f"**Kept weights (keep_best): epoch {best['epoch']}**, {best['metric']} "
        f"{best['value']:.4g} ({best['mode']}){where}; the dotted gold line in "
        "`training.png`.\n"
    ]
