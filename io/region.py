"""Regions of a sample, for spatial decomposition: each spatial rank reads only its part.

A region is given in one sample's coordinates, the sample axis removed (axis 0 is
the channels, axis 1 the first spatial axis), as ``{axis: (lo, hi)}``, half-open.
Bounds are always in whole-sample coordinates (those of ``sample_shape``), so every
rank of a layout can compute its region from the sample shape alone. A region of a
region view composes: it must lie inside the view's region, and narrows it. Only the
inputs (x) are cut; targets (y) are read whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError, DataError

Bounds = tuple[tuple[int, int], ...]  # per axis of a sample: [lo, hi)


def full_bounds(shape: Sequence[int]) -> Bounds:
    """The region that is the whole sample."""
    return tuple((0, int(n)) for n in shape)


def bounds_shape(bounds: Bounds) -> tuple[int, ...]:
    """The shape of one sample as a region view reads it."""
    return tuple(hi - lo for lo, hi in bounds)


class RegionView:
    """What a source with a region view answers from its ``sample_shape`` and the region
    it holds (``_region``: None for the whole sample; set by its ``region()``)."""

    _region: Bounds | None = None

    @property
    def region_bounds(self) -> Bounds:
        """``(lo, hi)`` per axis of a sample that this source reads (whole: no region)."""
        return self._region if self._region is not None else full_bounds(self.sample_shape)

    @property
    def region_shape(self) -> tuple[int, ...]:
        """One sample's x shape as this source reads it."""
        return bounds_shape(self.region_bounds)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def compose(owner: str, region: Any, shape: Sequence[int], current: Bounds | None) -> Bounds:
    """The bounds of ``owner.region(region)`` on samples of ``shape``, validated; a region
    of a region view (``current``) must lie inside it."""
    call = f"{owner}.region({region!r})"
    if not isinstance(region, Mapping):
        raise ConfigError(
            f"{call}: give a dict {{axis: (lo, hi)}} of half-open ranges, e.g. {{1: (0, 16)}} "
            "for the first 16 along the first spatial axis"
        )
    ndim = len(shape)
    if ndim == 0:
        raise ConfigError(f"{call}: each sample is a scalar, with no axis to cut; read it whole")
    bounds = list(current if current is not None else full_bounds(shape))
    for axis, span in region.items():
        if not _is_int(axis) or not 0 <= axis < ndim:
            raise ConfigError(
                f"{call}: axis {axis!r} is not an axis of a sample of shape {tuple(shape)}; "
                f"use 0..{ndim - 1} (the sample axis is not counted: 0 is the channels, 1 the "
                "first spatial axis)"
            )
        axis = int(axis)
        if not (isinstance(span, (tuple, list)) and len(span) == 2 and all(map(_is_int, span))):
            raise ConfigError(
                f"{call}: axis {axis} needs a pair of ints (lo, hi), the half-open range "
                f"[lo, hi) to read, got {span!r}"
            )
        lo, hi = int(span[0]), int(span[1])
        extent = int(shape[axis])
        if not 0 <= lo < hi <= extent:
            what = "is empty" if 0 <= hi <= lo <= extent else "lies outside the sample"
            raise ConfigError(
                f"{call}: axis {axis} range [{lo}, {hi}) {what}; axis {axis} has extent {extent} "
                f"(sample shape {tuple(shape)}): give 0 <= lo < hi <= {extent}"
            )
        was_lo, was_hi = bounds[axis]
        if current is not None and not was_lo <= lo < hi <= was_hi:
            raise ConfigError(
                f"{call}: this source is already a region, axis {axis} [{was_lo}, {was_hi}); "
                f"a region of a region is in whole-sample coordinates and must lie inside it: "
                f"give {was_lo} <= lo < hi <= {was_hi}, or call region() on the whole source"
            )
        bounds[axis] = (lo, hi)
    return tuple(bounds)


def common_shape(owner: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The one sample shape every x array shares (a region cuts them all alike)."""
    distinct = set(shapes.values())
    if len(distinct) != 1:
        listed = ", ".join(f"{field} {shape}" for field, shape in shapes.items())
        raise DataError(
            f"{owner}: its inputs have different sample shapes ({listed}), so one region "
            "cannot cut them all; use a source with one input, or inputs of one shape, for "
            "spatial decomposition"
        )
    return distinct.pop()


def array_cuts(
    bounds: Bounds, shape: Sequence[int], sample_axis: int
) -> dict[int, tuple[int, int]]:
    """The cut axes of an array of ``shape`` whose sample axis is ``sample_axis``, in the
    array's own axis numbers (the sample axis may be anywhere in storage)."""
    axes = [a for a in range(len(shape)) if a != sample_axis]
    return {
        axes[k]: (lo, hi) for k, (lo, hi) in enumerate(bounds) if (lo, hi) != (0, shape[axes[k]])
    }


def chunk_range(lo: int, hi: int, unit: int) -> range:
    """Indices of the chunks of ``unit`` elements that hold any of ``[lo, hi)``."""
    return range(lo // unit, math.ceil(hi / unit))
