"""The fit's training clock across runs: a fit resumed from a checkpoint goes on from
the seconds its earlier runs trained, so step times, ``train_seconds`` and the
summary's samples/s cover the whole fit, not only its last run.

Each run (the first submission, each resume) is one *segment* of
``history.info["segments"]``: the steps it trained (``start_step`` to ``end_step``,
end excluded), their samples and the seconds it trained for. A checkpoint's history
holds the segments up to it (the run that wrote it ends at its step), so a resume
adds its own after them; the seconds a stopped run spent after its last checkpoint
trained steps the resume trains again, and count in neither.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any


class RunClock:
    """Seconds since training began, over every run of the fit: this run's (from
    :meth:`start`, once its replicas are up) after the ``earlier`` runs' total."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.started_at = time.time()  # this run's start, on the calendar
        self.earlier: list[dict[str, Any]] = []  # the runs before this one
        self.start_step = 0  # this run's first step

    def start(self) -> None:
        """This run's replicas are up: its clock starts now."""
        self.started, self.started_at = time.perf_counter(), time.time()

    def resumed(self, history: Mapping[str, Any], step: int) -> None:
        """A resume from a checkpoint of ``step`` whose history is ``history`` (a dict of
        steps, info): the runs it records come before this one."""
        self.earlier = earlier_segments(history, step)
        self.start_step = step

    @property
    def offset(self) -> float:
        """The seconds the earlier runs trained."""
        return sum(float(s["seconds"]) for s in self.earlier)

    def elapsed(self) -> float:
        """This run's seconds so far."""
        return time.perf_counter() - self.started

    def now(self) -> float:
        """The fit's training seconds so far: a step's ``time``."""
        return self.offset + self.elapsed()

    def segments(self, end_step: int, samples: int, run_id: Any = None) -> list[dict[str, Any]]:
        """The earlier runs and this one up to ``end_step`` (excluded), the fit having
        trained ``samples`` in all."""
        before = sum(int(s.get("samples", 0)) for s in self.earlier)
        this = {
            "run": len(self.earlier),
            "run_id": run_id,
            "start_step": self.start_step,
            "end_step": max(end_step, self.start_step),
            "samples": max(samples - before, 0),
            "seconds": self.elapsed(),
            "started_at": self.started_at,
        }
        return [dict(s) for s in self.earlier] + [this]


def earlier_segments(history: Mapping[str, Any], step: int) -> list[dict[str, Any]]:
    """The runs a checkpoint's history records, up to its ``step``. A history written
    before segments were recorded counts as one run, as long as its last step's
    ``time`` (its steps' times restarted at each resume, so that is a lower bound)."""
    info = history.get("info") or {}
    saved = info.get("segments")
    if saved:
        return [dict(s) for s in saved]
    steps: Sequence[Mapping[str, Any]] = history.get("steps") or []
    if not steps:
        return []
    return [
        {
            "run": 0,
            "run_id": info.get("run_id"),
            "start_step": 0,
            "end_step": step,
            "samples": sum(int(s["samples"]) for s in steps),
            "seconds": max(float(s["time"]) for s in steps),
            "started_at": None,
        }
    ]


def train_seconds(segments: Sequence[Mapping[str, Any]]) -> float:
    """The fit's training seconds: its runs' together."""
    return sum(float(s["seconds"]) for s in segments)
