"""A ``PatchSource``'s arguments checked against its arrays' shapes: which axes are cut,
how long, where y sits, which windows are samples, what a sample looks like (pure: the
arrays are only asked their shapes, names and dtypes).

Every mistake is a ``ConfigError`` naming the argument and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError
from dataflow.io.windows import check_corners, grid_corners, keep_masked


@dataclass(frozen=True)
class Geometry:
    """The windows of a ``PatchSource``, over the patch ``axes`` of x (sorted)."""

    dims: tuple[str, ...] | None  # x's dimension names, where it has them
    axes: tuple[int, ...]  # the patch dims, as x's axes, sorted
    patch: tuple[int, ...]  # per patch axis
    stride: tuple[int, ...]
    extents: tuple[int, ...]  # x's length along each patch axis
    shape: tuple[int, ...]  # x's (each x array's) whole shape
    corners: np.ndarray  # (n, d) int64, C order
    y_shift: np.ndarray  # (d,) int64: y's corner minus x's
    y_extent: tuple[int, ...]  # y's window length per patch axis
    y_axes: tuple[int, ...]  # y's axis of each patch axis
    y_full: tuple[int, ...] | None  # y's whole shape (None: no y)
    fold_axes: tuple[int, ...]  # x axes folded into the channel axis
    variables: int  # V, the x arrays stacked
    cell_bytes: int  # bytes of x and y per cell of the patch dims

    @property
    def cut_shape(self) -> tuple[int, ...]:
        """One x array's window: its shape with the patch axes cut."""
        return _cut(self.shape, self.axes, self.patch)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        cut = self.cut_shape
        folded = math.prod(cut[a] for a in self.fold_axes)
        rest = tuple(n for a, n in enumerate(cut) if a not in self.fold_axes)
        return (self.variables * folded, *rest)

    @property
    def y_shape(self) -> tuple[int, ...] | None:
        return None if self.y_full is None else _cut(self.y_full, self.y_axes, self.y_extent)

    def fold(self, x: np.ndarray) -> np.ndarray:
        """``(n, V, *cut_shape)`` -> ``(n, *sample_shape)``: the folded axes after V."""
        if not self.fold_axes:
            return x
        moved = np.moveaxis(x, [2 + a for a in self.fold_axes], range(2, 2 + len(self.fold_axes)))
        folded = moved.shape[1 : 2 + len(self.fold_axes)]
        rest = moved.shape[2 + len(self.fold_axes) :]  # a region may have narrowed them
        return np.ascontiguousarray(moved).reshape(len(x), math.prod(folded), *rest)

    def x_window(
        self, region: Sequence[tuple[int, int]] | None
    ) -> tuple[np.ndarray, tuple[int, ...], dict[int, tuple[int, int]]]:
        """Where x is read within a window under a spatial ``region`` (``(lo, hi)`` per
        sample axis, ``io.region``; None: the whole window): the offset and length along
        each patch axis, and ``{axis: (lo, hi)}`` of x's other (whole) axes it narrows.
        The channel axis (region axis 0) is cut after a unit is assembled."""
        offset, extent = np.zeros(len(self.axes), np.int64), list(self.patch)
        narrowed: dict[int, tuple[int, int]] = {}
        if region is None:
            return offset, tuple(extent), narrowed
        unfolded = [a for a in range(len(self.shape)) if a not in self.fold_axes]
        for axis, (lo, hi) in zip(unfolded, region[1:], strict=True):
            if axis in self.axes:
                j = self.axes.index(axis)
                offset[j], extent[j] = lo, hi - lo
            else:
                narrowed[axis] = (lo, hi)
        return offset, tuple(extent), narrowed

    def _by_name(self, values: Sequence[int]) -> dict[Any, int]:
        names = self.dims if self.dims is not None else None
        return {(names[a] if names else a): int(v) for a, v in zip(self.axes, values, strict=True)}

    @property
    def patch_by_name(self) -> dict[Any, int]:
        return self._by_name(self.patch)

    @property
    def stride_by_name(self) -> dict[Any, int]:
        return self._by_name(self.stride)


def _cut(shape: Sequence[int], axes: Sequence[int], lengths: Sequence[int]) -> tuple[int, ...]:
    out = list(shape)
    for axis, n in zip(axes, lengths, strict=True):
        out[axis] = int(n)
    return tuple(out)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _axis(field: str, key: Any, dims: tuple[str, ...] | None, shape: tuple[int, ...]) -> int:
    """x's axis that ``key`` (a dimension name or an axis) names."""
    if isinstance(key, str):
        if dims is None or key not in dims:
            raise ConfigError(
                f"PatchSource({field}=...): {key!r} is not a dimension of x (its dimensions "
                f"are {dims if dims is not None else 'unnamed'}, shape {shape}); name one of "
                "those, or give the axis as an int"
            )
        return dims.index(key)
    if not _is_int(key) or not -len(shape) <= key < len(shape):
        raise ConfigError(
            f"PatchSource({field}=...): {key!r} is not an axis of x (shape {shape}); give an "
            f"axis 0..{len(shape) - 1} or a dimension name"
        )
    return int(key) % len(shape)


def _lengths(
    field: str, values: Any, dims: tuple[str, ...] | None, shape: tuple[int, ...], low: int
) -> dict[int, int]:
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"PatchSource({field}={values!r}): give a dict {{dimension name or axis: length}}, "
            "e.g. {'lat': 32, 'lon': 32}"
        )
    out: dict[int, int] = {}
    for key, n in values.items():
        axis = _axis(field, key, dims, shape)
        if not _is_int(n) or n < low:
            raise ConfigError(f"PatchSource({field}={{{key!r}: {n!r}}}): must be an int >= {low}")
        if axis in out:
            raise ConfigError(f"PatchSource({field}=...): dim {key!r} is given twice")
        out[axis] = int(n)
    return out


def resolve_geometry(
    *,
    x: Sequence[Any],
    y: Any,
    patch: Any,
    stride: Any,
    windows: Any,
    mask: Any,
    mask_fraction: float,
    y_shift: Any,
    y_patch: Any,
    channels: Sequence[Any],
) -> Geometry:
    """The checked geometry of windows of arrays ``x`` (and ``y``); see ``PatchSource``."""
    first = x[0]
    shape, dims = first.shape, first.dims
    for other in x[1:]:
        if other.shape != shape:
            raise ConfigError(
                f"PatchSource(x=...): {other.field} ({other.name!r}) has shape {other.shape} "
                f"but {first.field} ({first.name!r}) has {shape}; arrays stacked as channels "
                "need one shape"
            )
    cut = _lengths("patch", patch, dims, shape, 1)
    if not cut:
        raise ConfigError("PatchSource(patch={}): name at least one dim to cut windows along")
    axes = tuple(sorted(cut))
    for axis in axes:
        if cut[axis] > shape[axis]:
            raise ConfigError(
                f"PatchSource(patch=...): {cut[axis]} along {_name(dims, axis)} is longer than "
                f"x there ({shape[axis]}); give a patch of at most {shape[axis]}"
            )
    steps = dict(cut)
    if stride is not None:
        if windows is not None:
            raise ConfigError(
                "PatchSource: give stride= (a grid of windows) or windows= (explicit corners), "
                "not both"
            )
        given = _lengths("stride", stride, dims, shape, 1)
        for axis in given:
            if axis not in cut:
                raise ConfigError(
                    f"PatchSource(stride=...): {_name(dims, axis)} is not a patch dim; stride "
                    f"only the dims of patch= ({', '.join(_name(dims, a) for a in axes)})"
                )
        steps.update(given)
    p = tuple(cut[a] for a in axes)
    s = tuple(steps[a] for a in axes)
    extents = tuple(shape[a] for a in axes)
    shift, y_ext, y_axes = _y_geometry(y, y_shift, y_patch, dims, shape, axes, cut)
    lows = [max(0, -k) for k in shift]
    highs = [e - n for e, n in zip(extents, p, strict=True)]
    if y is not None:
        highs = [min(h, e - q - k) for h, e, q, k in zip(highs, extents, y_ext, shift, strict=True)]
    if windows is not None:
        corners = check_corners(windows, extents, p)
        outside = ((corners < lows) | (corners > highs)).any(axis=1)
        if outside.any():
            raise ConfigError(
                f"PatchSource(windows=...): the window at {corners[outside][0].tolist()} has "
                f"its y (shifted by {list(shift)}, {list(y_ext)} long) outside the array; drop "
                "it or change y_shift"
            )
    else:
        corners = grid_corners(lows, highs, s)
        if len(corners) == 0:
            free = grid_corners([0] * len(p), [e - n for e, n in zip(extents, p, strict=True)], s)
            if len(free) and y is not None:
                raise ConfigError(
                    f"PatchSource(y_shift={y_shift!r}, y_patch={y_patch!r}): y would fall "
                    "outside the array for every window; shorten the shift or the patch"
                )
            raise ConfigError(f"PatchSource(patch={patch!r}): no window fits in x {shape}")
    if mask is not None:
        corners = _masked(mask, mask_fraction, corners, extents, p)
    fold = tuple(sorted({_axis("channels", c, dims, shape) for c in channels}))
    cells = [math.prod(n for a, n in enumerate(arr.shape) if a not in axes) for arr in x]
    cell_bytes = sum(c * arr.dtype.itemsize for c, arr in zip(cells, x, strict=True))
    if y is not None:
        rest = math.prod(n for a, n in enumerate(y.shape) if a not in y_axes)
        cell_bytes += rest * y.dtype.itemsize
    return Geometry(
        dims=dims,
        axes=axes,
        patch=p,
        stride=s,
        extents=extents,
        shape=shape,
        corners=corners,
        y_shift=np.asarray(shift, dtype=np.int64),
        y_extent=y_ext,
        y_axes=y_axes,
        y_full=None if y is None else y.shape,
        fold_axes=fold,
        variables=len(x),
        cell_bytes=cell_bytes,
    )


def _name(dims: tuple[str, ...] | None, axis: int) -> str:
    return str(dims[axis]) if dims else f"axis {axis}"


def _y_geometry(
    y: Any,
    y_shift: Any,
    y_patch: Any,
    dims: tuple[str, ...] | None,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    cut: dict[int, int],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """y's corner offset and window length per patch axis, and y's patch axes."""
    if y is None:
        if y_shift is not None or y_patch is not None:
            raise ConfigError(
                "PatchSource(y_shift=/y_patch=): place a target window, so they need y=; "
                "name the target array"
            )
        return (0,) * len(axes), tuple(cut[a] for a in axes), axes
    y_axes = _y_axes(y, dims, shape, axes)
    shifts = {} if y_shift is None else _lengths("y_shift", y_shift, dims, shape, -(2**62))
    lengths = {} if y_patch is None else _lengths("y_patch", y_patch, dims, shape, 1)
    for field, given in (("y_shift", shifts), ("y_patch", lengths)):
        for axis in given:
            if axis not in cut:
                raise ConfigError(
                    f"PatchSource({field}=...): {_name(dims, axis)} is not a patch dim; give "
                    f"it a patch length, or use one of {', '.join(_name(dims, a) for a in axes)}"
                )
    for axis, n in lengths.items():
        if n > shape[axis]:
            raise ConfigError(
                f"PatchSource(y_patch=...): {n} along {_name(dims, axis)} is longer than y "
                f"there ({shape[axis]})"
            )
    return (
        tuple(shifts.get(a, 0) for a in axes),
        tuple(lengths.get(a, cut[a]) for a in axes),
        y_axes,
    )


def _y_axes(
    y: Any, dims: tuple[str, ...] | None, shape: tuple[int, ...], axes: tuple[int, ...]
) -> tuple[int, ...]:
    """y's axis for each patch axis of x: by dimension name where both have names (y may
    lack x's other dims, e.g. labels without the channel dim), else the same axis."""
    named = dims is not None and y.dims is not None
    patch_dims = [_name(dims, a) for a in axes]
    if named and all(dims[a] in y.dims for a in axes):
        y_axes = tuple(y.dims.index(dims[a]) for a in axes)
    elif not named and len(y.shape) == len(shape):
        y_axes = axes
    else:
        y_axes = ()
    differ = [
        f"{_name(dims, a)}: y {y.shape[b]}, x {shape[a]}"
        for a, b in zip(axes, y_axes or axes, strict=True)
        if y_axes and y.shape[b] != shape[a]
    ]
    if differ:  # found, but of another length
        raise ConfigError(
            f"PatchSource(y={y.name!r}): y's extent differs from x's along the patch "
            f"dim(s) ({'; '.join(differ)}), so its windows could not be cut where x's are; "
            "write y over the same grid as x (or cut x to y's extent, e.g. a split of both)"
        )
    if not y_axes:
        raise ConfigError(
            f"PatchSource(y={y.name!r}): y has shape {y.shape} (dims {y.dims}), x {shape} "
            f"(dims {dims}); y needs each patch dim ({', '.join(patch_dims)}) as long as x's, "
            "to be cut at the same place (found by name, else by axis when y has x's rank): "
            "name both arrays' dims (zarr's dimension_names, e.g. ('level', 'lat', 'lon') "
            "for x and ('lat', 'lon') for y), or give y x's rank"
        )
    if list(y_axes) != sorted(y_axes):
        raise ConfigError(
            f"PatchSource(y={y.name!r}): y's dims {y.dims} hold the patch dims in another "
            f"order than x's {dims}; write y with the patch dims in x's order"
        )
    return y_axes


def _masked(
    mask: Any, fraction: float, corners: np.ndarray, extents: tuple[int, ...], p: tuple[int, ...]
) -> np.ndarray:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ConfigError(f"PatchSource(mask_fraction={fraction!r}): a number in (0, 1]")
    if not 0 < fraction <= 1:
        raise ConfigError(
            f"PatchSource(mask_fraction={fraction}): a number in (0, 1] (1.0: the mask is True "
            "over the whole window)"
        )
    array = np.asarray(mask)
    if array.shape != extents:
        raise ConfigError(
            f"PatchSource(mask=...): shape {array.shape}, but x along the patch dims is "
            f"{extents}; give a boolean array of that shape (True where windows may lie)"
        )
    kept = keep_masked(array.astype(bool), corners, p, float(fraction))
    if len(kept) == 0:
        raise ConfigError(
            f"PatchSource(mask=...): no window has its mask True on at least {fraction:.0%} of "
            "its cells; check the mask (True: valid) or lower mask_fraction"
        )
    return kept
