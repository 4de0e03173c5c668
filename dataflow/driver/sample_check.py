"""The samples of committed windows: recorded in the sample ledger from the plan, and
checked against the 64-bit digest each replica reported of the indices it read.

Each replica reads a prefix of its epoch stream, so a window's samples follow from the
plan; the replicas send only a digest of what they read. The recorder calls
:meth:`SampleCheck.record` once per committed window.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import numpy as np

from dataflow.core.digest import index_hashes
from dataflow.core.errors import DataError

_DIGEST = attrgetter("sample_digest")  # read for every replica in C (map)
_TAKEN_OVER = attrgetter("taken_over")


class SampleCheck:
    """``load``: the Load stage (its epoch streams), ``seed``: the fit's shuffle seed."""

    def __init__(self, load: Any, seed: int) -> None:
        self.load, self.seed = load, seed
        self._layouts: dict[int, EpochLayout] = {}  # step -> its epoch's streams
        self._layout_of: tuple = ()

    def record(
        self,
        ledger: Any,
        segment: tuple,
        specs: tuple,
        window: list,
        salvaged: list,
        parts_moved: bool = False,
    ) -> None:
        """The window is committed: its samples go to ``ledger`` (which refuses a repeat),
        and each replica's digest is checked against the plan's, every replica at once.
        ``parts_moved``: parts may have moved between replicas (sample leases) even
        where no known result says so (a lost replica's result is unknown)."""
        if self._layout_of is not segment:
            self._layouts = {}
            for epoch, epoch_steps, streams in self.load.epoch_streams(segment, self.seed):
                layout = EpochLayout.of(epoch, epoch_steps, streams)
                for spec in epoch_steps:
                    self._layouts[spec.index] = layout
            self._layout_of = segment
        reported = np.array(list(map(_DIGEST, window)), dtype=object)  # None: unknown
        expected = np.zeros(len(window), dtype=np.uint64)
        for layout in dict.fromkeys(self._layouts[spec.index] for spec in specs):
            mine = [spec.index for spec in specs if self._layouts[spec.index] is layout]
            start, stop = layout.cumulative(mine[0]), layout.cumulative(mine[-1] + 1)
            positions = ledger.record_spans(layout.epoch, layout.flat, layout.bounds, start, stop)
            with np.errstate(over="ignore"):
                expected += layout.digests(positions, stop - start)
        known = np.not_equal(reported, None).astype(bool)
        known[salvaged] = False
        got = np.where(known, reported, 0).astype(np.uint64)
        if parts_moved or any(map(_TAKEN_OVER, window)):
            # Sample leases: replicas took over each other's parts, so only the window's
            # whole is the plan's (digests add up); each part was claimed exactly once.
            # A lost replica's digest is unknown: then the sum cannot be checked.
            if not known.all():
                return
            with np.errstate(over="ignore"):
                if got.sum() != expected.sum():
                    raise DataError(
                        f"the replicas together read other samples than the plan gave them "
                        f"in steps {specs[0].index}-{specs[-1].index} (sample leases): a part "
                        "was lost or trained twice; please report this with the plan"
                    )
            return
        wrong = np.flatnonzero(known & (got != expected))
        if len(wrong):
            raise DataError(
                f"replica {int(wrong[0])} read other samples than the plan gave it in steps "
                f"{specs[0].index}-{specs[-1].index}: the loader lost or repeated data; "
                "please report this with the plan (Pipeline.plan())"
            )


class EpochLayout:
    """One epoch's streams, concatenated: replica ``r`` reads
    ``flat[bounds[r]:bounds[r + 1]]`` in order, ``cumulative(step)[r]`` of it before
    ``step``."""

    def __init__(
        self, epoch: int, first: int, flat: np.ndarray, bounds: np.ndarray, cum: np.ndarray
    ) -> None:
        self.epoch, self.first, self.flat, self.bounds, self.cum = epoch, first, flat, bounds, cum
        self._hashes: np.ndarray | None = None

    @classmethod
    def of(cls, epoch: int, steps: list, streams: list[np.ndarray]) -> EpochLayout:
        lengths = np.array([len(s) for s in streams], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        flat = np.concatenate(streams) if streams else np.zeros(0, dtype=np.int64)
        local = np.array([spec.local_batches for spec in steps], dtype=np.int64)
        cum = np.concatenate([np.zeros((1, len(streams)), np.int64), np.cumsum(local, axis=0)])
        return cls(epoch, steps[0].index, flat, bounds, cum)

    def cumulative(self, step: int) -> np.ndarray:
        return self.cum[step - self.first]

    def digests(self, positions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Each replica's digest of ``flat[positions]`` (replica by replica, ``lengths``)."""
        if self._hashes is None:
            self._hashes = index_hashes(self.flat)
        out = np.zeros(len(lengths), dtype=np.uint64)
        if len(positions):
            starts = np.cumsum(lengths) - lengths
            nonempty = lengths > 0
            with np.errstate(over="ignore"):
                sums = np.add.reduceat(self._hashes[positions], starts[nonempty])
            out[nonempty] = sums
        return out
