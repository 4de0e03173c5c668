"""The sample ledger: which samples each replica consumed in each epoch.

Replicas report the indices they trained on; the driver records them here. A
sample recorded twice in one epoch (by any replica) is an error at once, never a
silent double count. One bit per sample per (epoch, replica) keeps the ledger
small (1M samples, 4 replicas, 100 epochs: 50 MB), so it can be kept whole and
later saved in checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from dataflow.core.errors import DataError


class SampleLedger:
    """Bitmaps of consumed sample indices per epoch and replica.

    The driver records a whole committed window at once (:meth:`record_many`): one
    repeat check over every replica's indices. Each epoch's union is kept unpacked
    (one byte per sample) while replicas report into it; each replica's own bitmap
    is only packed when asked for, so a round of 1,024 replicas costs one check,
    not 1,024 bitmap rewrites.
    """

    def __init__(self, num_samples: int) -> None:
        if num_samples < 1:
            raise DataError(f"SampleLedger: num_samples must be >= 1, got {num_samples}")
        self.num_samples = int(num_samples)
        self._bits: dict[tuple[int, int], np.ndarray] = {}  # (epoch, replica) -> packed bits
        self._union: dict[int, np.ndarray] = {}  # epoch -> consumed (bool, unpacked)
        self._unfiled: dict[tuple[int, int], list[np.ndarray]] = {}  # not yet in _bits
        # epoch -> [(flat streams, bounds, start, stop)]: replica r consumed
        # flat[bounds[r] + start[r] : bounds[r] + stop[r]] (record_spans)
        self._spans: dict[int, list[tuple[np.ndarray, ...]]] = {}
        self._distinct_flats: dict[int, tuple[np.ndarray, bool]] = {}  # see _distinct

    def _unpack(self, packed: np.ndarray | None) -> np.ndarray:
        if packed is None:
            return np.zeros(self.num_samples, dtype=bool)
        return np.unpackbits(packed, count=self.num_samples).astype(bool)

    def record(self, epoch: int, replica: int, indices: Iterable[int] | np.ndarray) -> None:
        """Mark ``indices`` consumed by ``replica`` in ``epoch``; refuse a repeat."""
        self.record_many(epoch, {replica: indices})

    def record_many(self, epoch: int, parts: Mapping[int, Iterable[int] | np.ndarray]) -> None:
        """Mark each replica's ``parts[replica]`` consumed in ``epoch``; refuse a repeat,
        naming the replica that reported it."""
        arrays = {r: np.asarray(v, dtype=np.int64).reshape(-1) for r, v in parts.items()}
        arrays = {r: a for r, a in arrays.items() if len(a)}
        if not arrays:
            return
        index = np.concatenate(list(arrays.values()))
        if index.min() < 0 or index.max() >= self.num_samples:
            bad = next(r for r, a in arrays.items() if a.min() < 0 or a.max() >= self.num_samples)
            raise DataError(
                f"SampleLedger: replica {bad} reported sample {int(arrays[bad].max())} in "
                f"epoch {epoch}, outside [0, {self.num_samples})"
            )
        union = self._union.get(epoch)
        if union is None:
            union = self._union[epoch] = np.zeros(self.num_samples, dtype=bool)
        seen = union[index]
        if seen.any() or len(np.unique(index)) != len(index):
            self._refuse(epoch, arrays, union)
        union[index] = True
        for replica, values in arrays.items():
            self._unfiled.setdefault((epoch, replica), []).append(values)

    def record_spans(
        self, epoch: int, flat: np.ndarray, bounds: np.ndarray, start: np.ndarray, stop: np.ndarray
    ) -> np.ndarray:
        """Every replica at once, vectorised: replica ``r`` consumed
        ``flat[bounds[r] + start[r] : bounds[r] + stop[r]]`` (its epoch stream is
        ``flat[bounds[r]:bounds[r + 1]]``, read in order). Refuses a repeat like
        :meth:`record`; returns the positions in ``flat`` it recorded, replica by replica."""
        lengths = stop - start
        if (start < 0).any() or (lengths < 0).any() or (stop > np.diff(bounds)).any():
            raise DataError(
                f"SampleLedger: a replica's span in epoch {epoch} leaves its epoch stream "
                "(start < 0, stop < start or stop past the stream's end)"
            )
        total = int(lengths.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        before = np.cumsum(lengths) - lengths
        positions = np.repeat(bounds[:-1] + start - before, lengths) + np.arange(total)
        index = flat[positions]
        union = self._union.get(epoch)
        if union is None:
            union = self._union[epoch] = np.zeros(self.num_samples, dtype=bool)
        if index.min() < 0 or index.max() >= self.num_samples:
            raise DataError(
                f"SampleLedger: sample {int(index.max())} in epoch {epoch} is outside "
                f"[0, {self.num_samples})"
            )
        if union[index].any() or (not self._distinct(flat) and _repeats(index)):
            parts = {
                r: flat[bounds[r] + start[r] : bounds[r] + stop[r]]
                for r in range(len(lengths))
                if lengths[r]
            }
            self._refuse(epoch, parts, union)
        union[index] = True
        self._spans.setdefault(epoch, []).append((flat, bounds, start.copy(), stop.copy()))
        return positions

    def _distinct(self, flat: np.ndarray) -> bool:
        """Whether the epoch streams ``flat`` hold each sample at most once, checked once
        per streams array: then spans inside the streams (checked) cannot repeat a
        sample within one call, and only the union check across calls is needed (a
        sort of every window's indices was most of a round's cost at 4,096 replicas)."""
        known = self._distinct_flats.get(id(flat))
        if known is None or known[0] is not flat:
            distinct = False
            if len(flat) and flat.min() >= 0 and flat.max() < self.num_samples:
                seen = np.zeros(self.num_samples, dtype=bool)
                seen[flat] = True  # no sort: one pass
                distinct = int(np.count_nonzero(seen)) == len(flat)
            known = self._distinct_flats[id(flat)] = (flat, distinct)
        return known[1]

    def _refuse(self, epoch: int, arrays: dict[int, np.ndarray], union: np.ndarray) -> None:
        seen = union.copy()
        for replica, values in arrays.items():
            unique, counts = np.unique(values, return_counts=True)
            repeated = unique[(counts > 1) | seen[unique]]
            if len(repeated):
                raise DataError(
                    f"SampleLedger: sample {int(repeated[0])} consumed twice in epoch {epoch} "
                    f"({len(repeated)} repeated, reported by replica {replica}); the data "
                    "sharding is wrong: please report this with the plan (Pipeline.plan())"
                )
            seen[unique] = True

    def _file(self, epoch: int, replica: int) -> np.ndarray | None:
        """The packed bitmap of (epoch, replica), with what was reported since."""
        unfiled = self._unfiled.pop((epoch, replica), None) or []
        for flat, bounds, start, stop in self._spans.get(epoch, ()):
            if replica < len(start) and stop[replica] > start[replica]:
                first = bounds[replica]
                unfiled.append(flat[first + start[replica] : first + stop[replica]])
        if unfiled:
            mine = self._unpack(self._bits.get((epoch, replica)))
            mine[np.concatenate(unfiled)] = True
            self._bits[(epoch, replica)] = np.packbits(mine)
        return self._bits.get((epoch, replica))

    @property
    def epochs(self) -> list[int]:
        return sorted(self._union)

    def replicas(self, epoch: int) -> list[int]:
        spans = {
            r
            for _, _, start, stop in self._spans.get(epoch, ())
            for r in np.flatnonzero(stop > start)
        }
        return sorted({r for e, r in (*self._bits, *self._unfiled) if e == epoch} | spans)

    def consumed(self, epoch: int, replica: int | None = None) -> np.ndarray:
        """Sorted sample indices consumed in ``epoch`` (by ``replica``, or by all)."""
        if replica is None:
            union = self._union.get(epoch)
            return np.flatnonzero(union) if union is not None else np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self._unpack(self._file(epoch, replica)))

    def unused(self, epoch: int) -> np.ndarray:
        """Samples nobody consumed in ``epoch`` (with ``drop_last``, fewer than a batch)."""
        union = self._union.get(epoch)
        return np.arange(self.num_samples) if union is None else np.flatnonzero(~union)

    def summary(self) -> dict[int, dict[str, int]]:
        """Per epoch: samples consumed and unused (what History saves)."""
        summary = {}
        for epoch in self.epochs:
            consumed = int(self._union[epoch].sum())
            summary[epoch] = {"consumed": consumed, "unused": self.num_samples - consumed}
        return summary


def _repeats(index: np.ndarray) -> bool:
    """Whether ``index`` holds a value twice."""
    return len(np.unique(index)) != len(index)
