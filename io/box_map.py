"""Where an array that is a box of a stored one lies in it (pure).

A split made in xarray (``ds.isel(lat=slice(5, 45))``, ``ds.sel(level=500)``) is read raw
from the stored zarr array (``io.xarray_slices``): the source sees the split's own
coordinates and shape, the reads the stored array's. :class:`BoxMap` turns one into the
other: every axis moved by the box's low corner, and each axis taken at one index
(``dropped``) put back with that index and length 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BoxMap:
    """``lo``: the box's low corner over the stored array's axes; ``dropped``: the stored
    axes taken at one index (``lo`` there), absent from the array the source sees."""

    lo: tuple[int, ...]
    dropped: tuple[int, ...] = ()

    @classmethod
    def identity(cls, ndim: int) -> BoxMap:
        return cls((0,) * ndim)

    @property
    def moves(self) -> bool:
        """Whether any coordinate differs between the two (not the whole array)."""
        return bool(self.dropped) or any(self.lo)

    @property
    def kept(self) -> list[int]:
        """The stored axes the source sees, in order."""
        return [a for a in range(len(self.lo)) if a not in self.dropped]

    @property
    def origin(self) -> tuple[int, ...]:
        """The low corner over the axes the source sees."""
        return tuple(self.lo[a] for a in self.kept)

    def corners(self, los: np.ndarray) -> np.ndarray:
        """Low corners ``(n, seen axes)`` as ``(n, stored axes)``."""
        if not self.moves:
            return los
        out = np.empty((len(los), len(self.lo)), dtype=np.int64)
        out[:, self.kept] = los + np.asarray(self.origin, dtype=np.int64)
        for axis in self.dropped:
            out[:, axis] = self.lo[axis]
        return out

    def box(self, lo: Sequence[int], hi: Sequence[int]) -> tuple[list[int], list[int]]:
        """The box ``[lo, hi)`` over the seen axes, over the stored axes."""
        if not self.moves:
            return [int(a) for a in lo], [int(b) for b in hi]
        stored_lo = [a for a in self.lo]
        stored_hi = [a + 1 for a in self.lo]
        for j, axis in enumerate(self.kept):
            stored_lo[axis] = self.lo[axis] + int(lo[j])
            stored_hi[axis] = self.lo[axis] + int(hi[j])
        return stored_lo, stored_hi

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """A window's shape over the seen axes, over the stored axes (1 where dropped)."""
        if not self.dropped:
            return tuple(int(n) for n in shape)
        out = [1] * len(self.lo)
        for j, axis in enumerate(self.kept):
            out[axis] = int(shape[j])
        return tuple(out)

    def seen(self, stored: Sequence[int]) -> tuple[int, ...]:
        """A tuple over the stored axes (a chunk shape) over the seen axes."""
        return tuple(int(stored[a]) for a in self.kept)

    def rows(self, out: np.ndarray) -> np.ndarray:
        """``out`` (a row per window, then the seen axes) viewed over the stored axes."""
        if not self.dropped:
            return out
        return np.expand_dims(out, tuple(1 + a for a in self.dropped))

    def squeeze(self, block: np.ndarray) -> np.ndarray:
        """A block read over the stored axes, over the seen axes (a view)."""
        return np.squeeze(block, axis=self.dropped) if self.dropped else block
