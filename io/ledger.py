"""The sample ledger: which samples each replica consumed in each epoch.

Replicas report the indices they trained on; the driver records them here. A
sample recorded twice in one epoch (by any replica) is an error at once, never a
silent double count. One bit per sample per (epoch, replica) keeps the ledger
small (1M samples, 4 replicas, 100 epochs: 50 MB), so it can be kept whole and
later saved in checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dataflow.core.errors import DataError


class SampleLedger:
    """Bitmaps of consumed sample indices per epoch and replica."""

    def __init__(self, num_samples: int) -> None:
        if num_samples < 1:
            raise DataError(f"SampleLedger: num_samples must be >= 1, got {num_samples}")
        self.num_samples = int(num_samples)
        self._bits: dict[tuple[int, int], np.ndarray] = {}  # (epoch, replica) -> packed bits
        self._union: dict[int, np.ndarray] = {}  # epoch -> packed bits

    def _unpack(self, packed: np.ndarray | None) -> np.ndarray:
        if packed is None:
            return np.zeros(self.num_samples, dtype=bool)
        return np.unpackbits(packed, count=self.num_samples).astype(bool)

    def record(self, epoch: int, replica: int, indices: Iterable[int] | np.ndarray) -> None:
        """Mark ``indices`` consumed by ``replica`` in ``epoch``; refuse a repeat."""
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(index) == 0:
            return
        if index.min() < 0 or index.max() >= self.num_samples:
            raise DataError(
                f"SampleLedger: replica {replica} reported sample {int(index.max())} in epoch "
                f"{epoch}, outside [0, {self.num_samples})"
            )
        union = self._unpack(self._union.get(epoch))
        unique, counts = np.unique(index, return_counts=True)
        repeated = unique[(counts > 1) | union[unique]]
        if len(repeated):
            raise DataError(
                f"SampleLedger: sample {int(repeated[0])} consumed twice in epoch {epoch} "
                f"({len(repeated)} repeated, reported by replica {replica}); the data sharding "
                "is wrong: please report this with the plan (Pipeline.plan())"
            )
        union[unique] = True
        self._union[epoch] = np.packbits(union)
        mine = self._unpack(self._bits.get((epoch, replica)))
        mine[unique] = True
        self._bits[(epoch, replica)] = np.packbits(mine)

    @property
    def epochs(self) -> list[int]:
        return sorted(self._union)

    def replicas(self, epoch: int) -> list[int]:
        return sorted(r for e, r in self._bits if e == epoch)

    def consumed(self, epoch: int, replica: int | None = None) -> np.ndarray:
        """Sorted sample indices consumed in ``epoch`` (by ``replica``, or by all)."""
        packed = self._union.get(epoch) if replica is None else self._bits.get((epoch, replica))
        return np.flatnonzero(self._unpack(packed))

    def unused(self, epoch: int) -> np.ndarray:
        """Samples nobody consumed in ``epoch`` (with ``drop_last``, fewer than a batch)."""
        return np.flatnonzero(~self._unpack(self._union.get(epoch)))

    def summary(self) -> dict[int, dict[str, int]]:
        """Per epoch: samples consumed and unused (what History saves)."""
        summary = {}
        for epoch in self.epochs:
            consumed = int(self._unpack(self._union[epoch]).sum())
            summary[epoch] = {"consumed": consumed, "unused": self.num_samples - consumed}
        return summary
