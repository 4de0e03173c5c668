"""One layout's predicted step and memory (:class:`LayoutPrediction`), and the table
``pipe.plan()`` and a fit with ``layout="auto"`` print of the candidates weighed
(:func:`format_table`). Pure: no torch, no Dask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dataflow.costmodel.layout_candidates import LayoutCandidate

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class LayoutPrediction:
    """One candidate's predicted step (seconds) and memory per worker (bytes).
    ``fits``: under the budget (None: no budget given). ``basis``: the measurement the
    prediction rests on (the layout model's :attr:`~LayoutModel.basis`: which
    calibration, when, at what): the same model and inputs give the same prediction."""

    candidate: LayoutCandidate
    global_batch: int
    local_batch: int
    micro_batches: int
    compute_s: float
    halo_s: float  # all halo traffic, hidden or not
    halo_exposed_s: float
    gather_s: float
    reduce_s: float
    allreduce_s: float
    allreduce_exposed_s: float
    fixed_s: float
    sync_s: float = 0.0  # waiting for the slowest rank at the synchronisation points
    halo_bytes: int  # received per step by the slowest rank, forward
    memory: Mapping[str, int]
    fits: bool | None = None
    basis: str = ""

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.halo_exposed_s
            + self.gather_s
            + self.reduce_s
            + self.allreduce_exposed_s
            + self.fixed_s
            + self.sync_s
        )

    @property
    def memory_bytes(self) -> int:
        return self.memory["total"]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["memory"] = dict(self.memory)
        out.update(
            layout=self.candidate.describe(), step_s=self.step_s, memory_bytes=self.memory_bytes
        )
        return out


def format_table(predictions: Sequence[LayoutPrediction]) -> str:
    """The candidates as ``pipe.plan()`` lists them: predicted step and memory."""
    header = ("layout", "local", "step ms", "compute", "halo", "gather", "reduce", "allreduce")
    header += ("wait",)
    header += ("MiB", "fits")
    rows = [header]
    for p in predictions:
        rows.append(
            (
                p.candidate.describe(),
                str(p.local_batch),
                f"{p.step_s * 1e3:.2f}",
                f"{p.compute_s * 1e3:.2f}",
                f"{p.halo_exposed_s * 1e3:.2f}",
                f"{p.gather_s * 1e3:.2f}",
                f"{p.reduce_s * 1e3:.2f}",
                f"{p.allreduce_exposed_s * 1e3:.2f}",
                f"{p.sync_s * 1e3:.2f}",
                f"{p.memory_bytes / MIB:.1f}",
                {None: "", True: "yes", False: "no"}[p.fits],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    bases = dict.fromkeys(p.basis for p in predictions if p.basis)
    return "\n".join([*lines, *(f"predicted from: {b}" for b in bases)])


__all__ = ["LayoutPrediction", "format_table"]
