"""What a fit measured: per step, per epoch and per phase, saved as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dataflow.core.errors import DataError
from dataflow.core.plain import to_plain
from dataflow.history.records import (
    EpochRecord,
    PhaseRecord,
    StepRecord,
    plain_rows,
    typed_rows,
)
from dataflow.io.ledger import SampleLedger


@dataclass
class History:
    """``steps``: loss, samples, seconds per global step; ``epochs``: mean train loss and
    evaluation metrics; ``phases``: global batch, lr, split, per-replica samples/s.

    A fit's rows are typed records (:mod:`dataflow.history.records`: ``StepRecord``,
    ``EpochRecord``, ``PhaseRecord``), which also read as dicts; a history loaded from
    JSON or restored from a checkpoint (``from_json``, ``from_dict``) holds the same
    records, reading key for key as the rows were written."""

    steps: list[Any] = field(default_factory=list)  # StepRecord (or dict)
    epochs: list[Any] = field(default_factory=list)  # EpochRecord (or dict)
    phases: list[Any] = field(default_factory=list)  # PhaseRecord (or dict)
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": plain_rows(self.steps),
            "epochs": plain_rows(self.epochs),
            "phases": plain_rows(self.phases),
            "info": self.info,
        }

    def to_json(self, path: str | Path) -> Path:
        """Strict JSON (:func:`to_plain` ``json=True``): NaN and infinities as the strings
        ``"nan"``, ``"inf"``, ``"-inf"``, tuples as lists, keys as strings."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_plain(self.to_dict(), where="History", json=True), indent=1))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        """The history of :meth:`to_dict`'s data (a checkpoint's, a JSON file's): its rows
        typed records again, as a fresh fit's are (``history.epochs[0].train_loss``
        whether the fit was resumed or not)."""
        sections = ("steps", "epochs", "phases", "info")
        if not isinstance(data, dict) or set(data) - set(sections):
            what = sorted(set(data) - set(sections)) if isinstance(data, dict) else type(data)
            raise DataError(
                f"not a history: {what} (a history has the keys {list(sections)}, as "
                "History.to_dict and History.to_json write them)"
            )
        return cls(
            steps=typed_rows(StepRecord, data.get("steps") or []),
            epochs=typed_rows(EpochRecord, data.get("epochs") or []),
            phases=typed_rows(PhaseRecord, data.get("phases") or []),
            info=dict(data.get("info") or {}),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> History:
        """The history :meth:`to_json` wrote, its rows typed records (NaN read back as
        float NaN from strict JSON's ``"nan"``)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]


@dataclass
class FitResult:
    """The trained model (synchronized weights, on the driver's CPU), its history, the
    sample ledger (which sample indices each replica trained on in each epoch), and the
    driver's log: every event its state machine handled and the commands it gave, as
    plain data (:class:`dataflow.driver.log.DriverLog`; ``dataflow.driver.machine.replay
    (log.config, log.events)`` makes the same decisions again: attach it to a bug
    report)."""

    model: torch.nn.Module
    history: History
    ledger: SampleLedger | None = None
    driver_log: Any = None
    # fit(keep_best=...): the weights of the epoch with the best watched metric (its
    # epoch and value in history.info["best"]); None without keep_best
    best_model: torch.nn.Module | None = None
    # ema_decay=...: the moving average of the weights at the fit's end (the trained
    # model's buffers, BatchNorm's statistics); None without ema_decay
    ema_model: torch.nn.Module | None = None

    def summary(self) -> str:
        h = self.history
        info = h.info
        samples = sum(s["samples"] for s in h.steps)
        seconds = info.get("train_seconds", 0.0) or float("nan")  # every run's, resumed
        runs = len(info.get("segments") or ())
        stopped = info.get("stopped_early")
        trained = epochs_trained(h, info.get("epochs"))
        lines = [
            f"trained {trained}, {len(h.steps)} steps, {samples} samples "
            f"on {info.get('replicas')} replica(s) in {seconds:.1f} s"
            f"{f' over {runs} runs' if runs > 1 else ''} ({samples / seconds:.0f} samples/s)",
        ]
        if (finished := info.get("already_finished")) is not None:
            lines.append(
                f"  already finished: returned from {finished['checkpoint']} (epoch "
                f"{finished['epoch']}); nothing trained by this call"
            )
        for phase in h.phases:
            lines.append(
                f"  phase {phase['phase']}: epochs {phase['start_epoch']}-{phase['end_epoch'] - 1}"
                f", global batch {phase['global_batch']}, lr {figure(phase['lr'])}, split "
                f"{phase['local_batches']}, samples/s per replica "
                f"{[round(v) for v in phase['samples_per_second']]}"
                + _progress_text(phase)
                + _captured_text(phase)
                + _retried_text(phase)
            )
        if (skipped := skipped_text(h)) is not None:
            lines.append(f"  {skipped}")
        if stopped:
            after, reason = stopped["after_epoch"], stopped["reason"]
            lines.append(f"  stopped early after epoch {after}: {reason}")
        if (best := info.get("best")) is not None:
            where = f"; saved to {best['path']}" if best.get("path") else ""
            lines.append(
                f"  best {best['metric']} {figure(best['value'])} after epoch {best['epoch']}"
                f" (result.best_model{where})"
            )
        lines.extend(_failures_text(info))
        for partial in info.get("partial_evaluations") or ():
            lines.append(
                f"  epoch {partial['epoch']}: the evaluation scored {partial['scored']} of "
                f"{partial['held_out']} held-out samples (a lost worker took its share's "
                "scores with it after the survivors had trained past that window)"
            )
        if h.epochs:
            last = h.epochs[-1]
            metrics = ", ".join(
                f"{k} {v:.4g}" for k, v in last.items() if k != "epoch" and isinstance(v, float)
            )
            lines.append(f"  epoch {last['epoch']}: {metrics}")
        return "\n".join(lines)


def _failures_text(info: dict[str, Any], shown: int = 4) -> list[str]:
    """What the fit recovered from, one line (``history.info["failures"]`` has each
    record), each worker taken back after it was dropped as hung or silent, and the
    workers that joined, one line (``history.info["regroups"]``)."""
    failures = info.get("failures") or ()
    lines = []
    if failures:
        told = [
            f"{f.get('reason')} (on from step {f.get('commit_step')})" for f in failures[:shown]
        ]
        more = f" and {len(failures) - shown} more" if len(failures) > shown else ""
        lines.append(
            f"  recovered from {len(failures)} failure(s): {'; '.join(told)}{more} "
            "(history.info['failures'])"
        )
    for back in info.get("readmitted") or ():
        lines.append(
            f"  {', '.join(back['workers'])} taken back from epoch {back['epoch']}, idle again "
            "after being dropped as hung or silent"
        )
    regroups = info.get("regroups") or ()
    if regroups:  # joiners: new workers, a scaled cluster, the readmitted above
        told = [
            f"{len(r['joined'])} at phase {r['phase']} ({r['replicas']} replicas on)"
            for r in regroups[:shown]
        ]
        more = f" and {len(regroups) - shown} more" if len(regroups) > shown else ""
        lines.append(f"  workers joined: {'; '.join(told)}{more} (history.info['regroups'])")
    return lines


def epochs_trained(history: History, asked: Any) -> str:
    """ "12 epoch(s)" of a fit of ``asked`` epochs; "3 of 12 epoch(s)" after a callback's
    early stop; "40 epoch(s) of data (15.07 epochs of progress, 15 asked)" where the
    schedule counted scale-invariant progress (its epochs are not the data's)."""
    if history.info.get("stopped_early") and history.epochs:
        return f"{int(history.epochs[-1]['epoch']) + 1} of {asked} epoch(s)"
    last = history.phases[-1] if history.phases else None
    if last is not None and last.get("progress_end") is not None:
        return (
            f"{last['end_epoch']} epoch(s) of data ({last['progress_end']:.2f} epochs of "
            f"progress, {asked} asked)"
        )
    return f"{asked} epoch(s)"


def _progress_text(phase: Any) -> str:
    """The summary's ", progress 2.00-4.39" for a phase that counted scale-invariant progress."""
    if phase.get("progress_end") is None:
        return ""
    return f", progress {phase['progress_start']:.2f}-{phase['progress_end']:.2f}"


def _captured_text(phase: Any) -> str:
    """``capture=True``: how many of the phase's steps each replica replayed as a CUDA
    graph, and why a shape could not be captured (empty without capture)."""
    replayed = phase.get("captured_steps")
    if replayed is None:
        return ""
    text = f", steps replayed as CUDA graphs per replica {replayed} of {phase['steps']}"
    failures = phase.get("capture_failures")
    return text + (f" (not captured: {'; '.join(failures)})" if failures else "")


def _retried_text(phase: Any) -> str:
    """Reads sent again to a store that failed for a while (``io.store_retry``): a store
    throttling the fit's readers is worth knowing of before it fails one."""
    retried = phase.get("store_retries") or []
    if not any(retried):
        return ""
    return f", store reads retried per replica {retried} (throttled or failing for a while)"


def figure(value: Any) -> str:
    """A float as the console shows it, to 4 significant digits (``0.02828``, not
    ``0.028284271247461905``); anything else as it is."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def skipped_steps(steps: list[Any], phase: int | None = None) -> list[int]:
    """The committed steps whose update was dropped as not finite (``skipped``), of
    ``phase`` or of every phase."""
    return [
        s["step"]
        for s in steps
        if s.get("skipped") is True and (phase is None or s.get("phase") == phase)
    ]


def skipped_text(history: History, shown: int = 10) -> str | None:
    """One line counting the skipped steps and naming the first ``shown``, or None."""
    steps = skipped_steps(history.steps)
    overflows = sum(int(p.get("overflow_steps") or 0) for p in history.phases)
    non_finite = sum(int(p.get("skipped_steps") or 0) for p in history.phases)
    count = len(steps) or non_finite + overflows
    if not count:
        return None
    names = ", ".join(str(i) for i in steps[:shown]) + (", ..." if len(steps) > shown else "")
    plural = "" if count == 1 else "s"
    which = f": step{'' if len(steps) == 1 else 's'} {names}" if steps else ""
    if overflows:  # precision="fp16": the loss scale's overflows, not failures
        scale = next(p.get("loss_scale") for p in reversed(history.phases))
        why = f"{overflows} for an fp16 overflow (loss scale now {scale:g})"
        if count > overflows:
            why += f" and {count - overflows} for a non-finite loss or gradient"
        reason = f"skipped, {why}"
    else:
        reason = "skipped for a non-finite loss or gradient (on_non_finite='skip')"
    return (
        f"{count} step{plural} {reason}{which}; {'it' if count == 1 else 'they'} changed no "
        "weight, optimizer state or buffer (BatchNorm statistics)"
    )
