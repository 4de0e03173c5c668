"""Timing samples screened before they become a cost model's terms.

A busy machine, a clock read at the wrong moment or a window that did less work than
planned gives a time far off the others: one such sample among a few can move a median,
and a median at one batch can bend the whole fit. :func:`screen` keeps the plausible
samples and says which it dropped and why:

1. within a batch: a sample more than ``ratio`` times off the median of its batch (20x
   too fast, 5x too slow) is discarded. Two samples that disagree by more than
   ``ratio`` are judged against the other batches (the one nearer the line through
   their medians stays), or both kept, as suspect, when there are none;
2. across batches: with three batches or more, a batch whose median is more than
   ``ratio`` times off the line through the other batches' medians is discarded
   (the worst first, while three remain); with three, only the middle one is judged (a
   line through two points, extrapolated to a third beyond them, moves with either
   point's noise: 15.7 ms at batch 21 was once discarded as 13x above the 1.2 ms that
   the line through 14.1 ms at 37 and 35.9 ms at 64 gave there);
3. in batch order: a larger batch never takes less time; a median below a smaller
   batch's is raised to it (and reported).

Every decision is a dict in :attr:`Screened.discarded` (``term``, ``batch``,
``seconds``, ``action``: ``"discarded"``, ``"raised"`` or ``"suspect"`` (kept, but
doubtful), ``reason``). Pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RATIO = 3.0  # a sample this many times off its reference is implausible


@dataclass(frozen=True)
class Screened:
    """What :func:`screen` kept: ``points`` (batch, median seconds of its kept samples),
    in batch order; how many samples were ``kept`` of ``total``; and each sample
    discarded or median raised, with why (``discarded``)."""

    points: tuple[tuple[int, float], ...]
    kept: int
    total: int
    discarded: tuple[dict[str, Any], ...] = ()

    def note(self, term: str = "") -> str:
        """One line: how many samples were used, and each one left out, with why."""
        dropped = sum(1 for d in self.discarded if d["action"] == "discarded")
        head = f"{term}: " if term else ""
        text = f"{head}{self.kept} of {self.total} timing sample(s) used, {dropped} discarded"
        groups: dict[tuple[int, str, str], list[float]] = {}
        for d in self.discarded:
            groups.setdefault((d["batch"], d["action"], d["reason"]), []).append(d["seconds"])
        parts = [
            f"batch {batch}: {', '.join(f'{s * 1e3:.3g}' for s in seconds)} ms {action} ({reason})"
            for (batch, action, reason), seconds in groups.items()
        ]
        return text + (": " + "; ".join(parts) if parts else "")


def screen(
    samples: Mapping[int, Sequence[float]], *, term: str = "compute", ratio: float = RATIO
) -> Screened:
    """``samples``: seconds measured at each batch (repeats of one measurement). See the
    module docstring for the three checks; ``term`` names them in the report."""
    if not ratio > 1:
        raise ValueError(f"screen(ratio={ratio}): must be > 1")
    dropped: list[dict[str, Any]] = []

    def drop(batch: int, seconds: float, reason: str, action: str = "discarded") -> None:
        dropped.append(dict(term=term, batch=batch, seconds=seconds, action=action, reason=reason))

    kept: dict[int, list[float]] = {}
    pairs: dict[int, list[float]] = {}  # two samples that disagree: judged in step 1b
    for batch in sorted(samples):
        values = []
        for s in samples[batch]:
            if isinstance(s, int | float) and math.isfinite(s) and s > 0:
                values.append(float(s))
            else:
                drop(batch, float("nan") if s is None else float(s), "not a positive time")
        if not values:
            continue
        if len(values) == 2 and max(values) / min(values) > ratio:
            pairs[batch] = values
            continue
        middle = statistics.median(values)
        for s in values:
            if s < middle / ratio or s > middle * ratio:
                faster = s < middle
                factor = middle / s if faster else s / middle
                drop(
                    batch,
                    s,
                    f"{factor:.1f}x {'faster' if faster else 'slower'} than the median of "
                    f"its batch, {middle * 1e3:.3g} ms",
                )
        kept[batch] = [s for s in values if middle / ratio <= s <= middle * ratio]
    for batch, values in pairs.items():  # 1b: the disagreeing pair, by the other batches
        medians = {b: statistics.median(v) for b, v in kept.items()}
        expected = _line_at(medians, batch)
        if expected is None:
            for s in values:
                drop(
                    batch,
                    s,
                    f"its batch's two samples disagree {max(values) / min(values):.1f}x and no "
                    "other batch says which is right: their mean is used",
                    action="suspect",
                )
            kept[batch] = values
            continue
        near = min(range(2), key=lambda i: abs(math.log(values[i] / expected)))
        for i, s in enumerate(values):
            if i != near:
                drop(
                    batch,
                    s,
                    f"its batch's two samples disagree {max(values) / min(values):.1f}x; the "
                    f"other batches' line expects {expected * 1e3:.3g} ms",
                )
        kept[batch] = [values[near]]
    medians = {b: statistics.median(v) for b, v in kept.items() if v}
    while len(medians) >= 3:  # 2: a batch far off the line through the others
        worst, off, expected = None, math.log(ratio), 0.0
        ends = (min(medians), max(medians))
        for batch, middle in medians.items():
            if len(medians) == 3 and batch in ends:
                continue  # a line through two points, extrapolated: it judges nothing
            line = _line_at({b: m for b, m in medians.items() if b != batch}, batch)
            if line is not None and abs(math.log(middle / line)) > off:
                worst, off, expected = batch, abs(math.log(middle / line)), line
        if worst is None:
            break
        middle = medians.pop(worst)
        factor = max(middle / expected, expected / middle)
        how = "below" if middle < expected else "above"
        for s in kept.pop(worst):
            drop(
                worst,
                s,
                f"its batch's median {middle * 1e3:.3g} ms is {factor:.1f}x {how} the line "
                f"through the other batches ({expected * 1e3:.3g} ms)",
            )
    points, best = [], 0.0
    for batch in sorted(medians):  # 3: a larger batch never runs faster
        middle = medians[batch]
        if middle < best:
            drop(
                batch,
                middle,
                f"faster than a smaller batch's {best * 1e3:.3g} ms; raised to it",
                action="raised",
            )
        best = max(best, middle)
        points.append((batch, best))
    total = sum(len(v) for v in samples.values())
    used = sum(len(kept[b]) for b in medians)
    return Screened(points=tuple(points), kept=used, total=total, discarded=tuple(dropped))


def discarded_note(discarded: Sequence[Mapping[str, Any]]) -> str:
    """One line for a model's notes: how many samples were discarded, adjusted or
    doubtful, in which terms (each, with why, is in the list itself)."""
    if not discarded:
        return "no timing sample was implausible: none discarded"
    dropped = sum(1 for d in discarded if d["action"] == "discarded")
    terms = sorted({str(d["term"]) for d in discarded})
    return (
        f"{dropped} timing sample(s) discarded, {len(discarded) - dropped} adjusted or "
        f"doubtful ({', '.join(terms)}): each one, with why, in CostModel.discarded"
    )


def _line_at(medians: Mapping[int, float], batch: int) -> float | None:
    """The line through ``medians`` (Theil-Sen: the median slope between pairs, the
    median intercept) at ``batch``; None with fewer than two points or not above 0."""
    pts = sorted(medians.items())
    if len(pts) < 2:
        return None
    slopes = [(t1 - t0) / (b1 - b0) for i, (b0, t0) in enumerate(pts) for b1, t1 in pts[i + 1 :]]
    slope = statistics.median(slopes)
    intercept = statistics.median(t - slope * b for b, t in pts)
    value = intercept + slope * batch
    return value if value > 0 else None


__all__ = ["RATIO", "Screened", "discarded_note", "screen"]
