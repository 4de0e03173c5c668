"""What a fit measured: per step, per epoch and per phase, saved as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dataflow.core.plain import to_plain
from dataflow.io.ledger import SampleLedger
from dataflow.records import plain_rows


@dataclass
class History:
    """``steps``: loss, samples, seconds per global step; ``epochs``: mean train loss and
    evaluation metrics; ``phases``: global batch, lr, split, per-replica samples/s.

    A fit's rows are typed records (:mod:`dataflow.records`: ``StepRecord``,
    ``EpochRecord``, ``PhaseRecord``), which also read as dicts; a history loaded from
    JSON holds dicts with the same keys."""

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
    def from_json(cls, path: str | Path) -> History:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]


@dataclass
class FitResult:
    """The trained model (synchronized weights, on the driver's CPU), its history, and the
    sample ledger (which sample indices each replica trained on in each epoch)."""

    model: torch.nn.Module
    history: History
    ledger: SampleLedger | None = None

    def summary(self) -> str:
        h = self.history
        info = h.info
        samples = sum(s["samples"] for s in h.steps)
        seconds = info.get("train_seconds", 0.0) or float("nan")
        lines = [
            f"trained {info.get('epochs')} epoch(s), {len(h.steps)} steps, {samples} samples "
            f"on {info.get('replicas')} replica(s) in {seconds:.1f} s "
            f"({samples / seconds:.0f} samples/s)",
        ]
        for phase in h.phases:
            lines.append(
                f"  phase {phase['phase']}: epochs {phase['start_epoch']}-{phase['end_epoch'] - 1}"
                f", global batch {phase['global_batch']}, lr {phase['lr']}, split "
                f"{phase['local_batches']}, samples/s per replica "
                f"{[round(v) for v in phase['samples_per_second']]}"
            )
        if h.epochs:
            last = h.epochs[-1]
            metrics = ", ".join(
                f"{k} {v:.4g}" for k, v in last.items() if k != "epoch" and isinstance(v, float)
            )
            lines.append(f"  epoch {last['epoch']}: {metrics}")
        return "\n".join(lines)
