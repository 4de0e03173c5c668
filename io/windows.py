"""Which windows of a large array are samples, and how they group into read units (pure).

A window is a box of the patch dims (``patch`` long along each) with its corner on the
grid ``0, stride, 2 * stride, ...``, or at an explicit corner. Samples are the windows
in C order of their corners (last dim fastest). Every function here takes and returns
numpy arrays of the patch dims only, in the array's axis order, so it is tested without
zarr (``io.patch_source`` maps them onto the store).

Read units (the engine's chunks, ``chunk_members``):

- :func:`block_units` (shuffled epochs): windows grouped by the block their corner
  falls in; a block is ``factor`` storage chunks along each patch dim. A unit reads the
  bounding box of its windows: the block plus the overhang of its last windows into the
  next block, so a storage chunk is fetched by its own block and the blocks before it
  along each dim: at most ``2 ** d`` times per epoch when ``patch <= block``.
  :func:`block_groups` numbers super-blocks of ``2 ** d`` neighbouring blocks: a
  shuffled epoch takes the super-blocks in a random order and their blocks in a random
  order, so the next units find the storage chunks they share with the previous ones
  in the reader's decoded-chunk cache (``io.chunk_cache``) instead of decoding them again.
- :func:`run_units` (unshuffled epochs): consecutive C-order runs whose bounding box
  stays within a byte budget, so the engine's unshuffled stream is exactly C order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dataflow.core.errors import ConfigError

DEFAULT_BLOCK_WINDOWS = 8  # block=None: a block holds at least this many grid windows
RUN_BYTES = 32 * 2**20  # shuffle=False: a unit's bounding box holds at most this much


def grid_corners(lows: Sequence[int], highs: Sequence[int], stride: Sequence[int]) -> np.ndarray:
    """Corners ``k * stride`` with ``low <= corner <= high`` along each dim, C order;
    shape ``(n, d)``, int64 (n = 0 when a dim has none)."""
    axes = [
        np.arange(0, high + 1, s, dtype=np.int64) for high, s in zip(highs, stride, strict=True)
    ]
    axes = [a[a >= low] for a, low in zip(axes, lows, strict=True)]
    if not axes:
        return np.zeros((1, 0), dtype=np.int64)
    mesh = np.meshgrid(*axes, indexing="ij")
    return np.stack([m.reshape(-1) for m in mesh], axis=1).astype(np.int64)


def sort_corners(corners: np.ndarray) -> np.ndarray:
    """Corners in C order (last dim fastest)."""
    if len(corners) == 0 or corners.shape[1] == 0:
        return corners
    return corners[np.lexsort(corners.T[::-1])]


def mask_counts(mask: np.ndarray, corners: np.ndarray, patch: Sequence[int]) -> np.ndarray:
    """How many True cells of ``mask`` (over the patch dims) each window covers: one
    summed-area table, ``2 ** d`` lookups per window, no loop over windows."""
    table = np.zeros(tuple(n + 1 for n in mask.shape), dtype=np.int64)
    table[(slice(1, None),) * mask.ndim] = mask.astype(np.int64)
    for axis in range(mask.ndim):
        np.cumsum(table, axis=axis, out=table)
    counts = np.zeros(len(corners), dtype=np.int64)
    for high in itertools.product((0, 1), repeat=mask.ndim):
        at = tuple(corners[:, j] + (patch[j] if high[j] else 0) for j in range(mask.ndim))
        sign = -1 if (mask.ndim - sum(high)) % 2 else 1
        counts += sign * table[at]
    return counts


def keep_masked(
    mask: np.ndarray, corners: np.ndarray, patch: Sequence[int], fraction: float
) -> np.ndarray:
    """The corners whose window has at least ``fraction`` of its cells True in ``mask``."""
    need = math.ceil(fraction * math.prod(patch) - 1e-9)
    return corners[mask_counts(mask, corners, patch) >= need]


def block_factor(
    chunks: Sequence[int], stride: Sequence[int], extents: Sequence[int], windows: int
) -> int:
    """The smallest whole number of storage chunks per block side for which a block holds
    at least ``windows`` grid windows (or covers the array)."""
    factor = 1
    while True:
        held = math.prod(max(1, c * factor // s) for c, s in zip(chunks, stride, strict=True))
        whole = all(c * factor >= e for c, e in zip(chunks, extents, strict=True))
        if held >= windows or whole:
            return factor
        factor += 1


def block_units(
    corners: np.ndarray, block: Sequence[int], origin: Sequence[int] | None = None
) -> list[np.ndarray]:
    """Window indices (rows of ``corners``, C order) grouped by the block of shape
    ``block`` that holds their corner; blocks in C order, each unit's indices sorted.
    ``origin``: where corner 0 is in the stored array (a box of it), so that blocks
    follow the stored chunks' edges, not the box's."""
    if len(corners) == 0:
        return []
    ids = _aligned(corners, block, origin) // np.asarray(block, dtype=np.int64)
    if ids.shape[1] == 0:
        return [np.arange(len(corners), dtype=np.int64)]
    key = np.ravel_multi_index(tuple(ids.T), tuple(int(m) + 1 for m in ids.max(axis=0)))
    order = np.argsort(key, kind="stable").astype(np.int64)
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    return np.split(order, cuts)


def block_groups(
    corners: np.ndarray,
    units: Sequence[np.ndarray],
    block: Sequence[int],
    span: int = 2,
    origin: Sequence[int] | None = None,
) -> list[int]:
    """A group id per unit of :func:`block_units`: the super-block of ``span`` blocks
    along each dim that holds it (``span ** d`` neighbouring blocks, which share the
    storage chunks their windows reach into), numbered 0.. in C order."""
    if not units or corners.shape[1] == 0:
        return [0] * len(units)
    first = corners[np.asarray([int(u[0]) for u in units], dtype=np.int64)]
    group = np.asarray(block, dtype=np.int64) * span
    ids = _aligned(first, group, origin) // group
    _, dense = np.unique(ids, axis=0, return_inverse=True)
    return [int(g) for g in np.asarray(dense).reshape(-1)]


def _aligned(corners: np.ndarray, block: Any, origin: Sequence[int] | None) -> np.ndarray:
    """``corners`` moved by ``origin`` modulo ``block``: blocks counted from ``-origin``
    (the stored array's edges) number as from 0, and ids stay as small as the box's."""
    if origin is None or not any(origin):
        return corners
    return corners + np.asarray(origin, dtype=np.int64) % np.asarray(block, dtype=np.int64)


def bounding_box(corners: np.ndarray, extent: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: the box holding every window of ``extent`` at ``corners``."""
    return corners.min(axis=0), corners.max(axis=0) + np.asarray(extent, dtype=np.int64)


def run_units(
    corners: np.ndarray, extent: Sequence[int], cell_bytes: int, budget: int = RUN_BYTES
) -> list[np.ndarray]:
    """Consecutive runs of window indices (C order) whose bounding box holds at most
    ``budget`` bytes (``cell_bytes`` per cell of the patch dims), or one window: rows
    (windows sharing all but the last corner) cut where the last dim's span would
    overflow, then merged while the box fits."""
    n = len(corners)
    if n == 0:
        return []
    d = corners.shape[1]
    if d == 0:
        return [np.arange(n, dtype=np.int64)]
    extent = np.asarray(extent, dtype=np.int64)
    row_cells = int(np.prod(extent[:-1])) * cell_bytes
    longest = max(1, budget // max(1, row_cells) - int(extent[-1]) + 1)  # last-dim span
    new_row = np.ones(n, dtype=bool)
    new_row[1:] = (corners[1:, :-1] != corners[:-1, :-1]).any(axis=1)
    row_start = np.maximum.accumulate(np.where(new_row, np.arange(n), 0))
    first = corners[row_start, -1]
    piece = (corners[:, -1] - first) // longest
    new_piece = new_row.copy()
    new_piece[1:] |= piece[1:] != piece[:-1]
    starts = [*np.flatnonzero(new_piece).tolist(), n]
    units, begin = [], 0
    lo, hi = None, None
    for a, b in itertools.pairwise(starts):
        p_lo, p_hi = bounding_box(corners[a:b], extent)
        if lo is not None:
            m_lo, m_hi = np.minimum(lo, p_lo), np.maximum(hi, p_hi)
            if int(np.prod(m_hi - m_lo)) * cell_bytes <= budget:
                lo, hi = m_lo, m_hi
                continue
            units.append(np.arange(begin, a, dtype=np.int64))
        begin, lo, hi = a, p_lo, p_hi
    units.append(np.arange(begin, n, dtype=np.int64))
    return units


def cut_windows(
    region: np.ndarray,
    lo: Sequence[int],
    corners: np.ndarray,
    extent: Sequence[int],
    axes: Sequence[int],
) -> np.ndarray:
    """The windows of ``extent`` (along ``axes``; the other axes whole) at ``corners``
    of ``region`` (read from ``lo``, over all its axes), stacked: ``(n, *window)``, C
    order. One advanced-index gather from a strided view of every window position, so
    tiny windows cost no Python per window (a copy per window as slicing would make)."""
    nd = region.ndim
    view = sliding_window_view(region, tuple(int(e) for e in extent), axis=tuple(axes))
    # the positions along the patch axes first, then each axis of a window in order
    where = {int(a): j for j, a in enumerate(axes)}
    order = [*where, *(nd + where[a] if a in where else a for a in range(nd))]
    offsets = tuple(corners[:, j] - int(lo[a]) for a, j in where.items())
    return view.transpose(order)[offsets]


def box_chunks(lo: Sequence[int], hi: Sequence[int], chunks: Sequence[int]) -> list[tuple]:
    """Coordinates of the storage chunks of shape ``chunks`` that the box ``[lo, hi)``
    touches."""
    ranges = [
        range(int(a) // c, (int(b) - 1) // c + 1) for a, b, c in zip(lo, hi, chunks, strict=True)
    ]
    return list(itertools.product(*ranges))


def window_chunks(
    los: np.ndarray, shape: Sequence[int], chunks: Sequence[int]
) -> set[tuple[int, ...]]:
    """Coordinates of the storage chunks of shape ``chunks`` that the windows of
    ``shape`` at the low corners ``los`` (``(n, ndim)``, over every axis) touch."""
    touched: set[tuple[int, ...]] = set()
    first = los // np.asarray(chunks, dtype=np.int64)
    last = (los + np.asarray(shape, dtype=np.int64) - 1) // np.asarray(chunks, dtype=np.int64)
    for a, b in zip(first.tolist(), last.tolist(), strict=True):
        touched.update(itertools.product(*(range(i, j + 1) for i, j in zip(a, b, strict=True))))
    return touched


Piece = tuple[int, tuple[slice, ...], tuple[Any, ...]]  # (cut, source in chunk, target)


def window_pieces(
    windows: Sequence[tuple[np.ndarray, Sequence[int]]], chunks: Sequence[int]
) -> dict[tuple[int, ...], list[Piece]]:
    """Per storage chunk (C order of coordinates) that the windows touch, where each
    part of it goes: ``(k, source, target)`` copies ``chunk[source]`` to
    ``outs[k][target]`` (``target`` starts with the window's row). ``windows[k]``: the
    low corners ``(n, ndim)`` over every axis, and the shape, of the windows of cut
    ``k``. A window overlapping ``m`` chunks is ``m`` pieces, each copied once."""
    pieces: dict[tuple[int, ...], list[Piece]] = {}
    for k, (los, shape) in enumerate(windows):
        for row, lo in enumerate(los.tolist()):
            spans = []
            for low, n, c in zip(lo, shape, chunks, strict=True):
                span = []
                for i in range(low // c, (low + n - 1) // c + 1):
                    start, stop = max(low, i * c), min(low + n, (i + 1) * c)
                    span.append(
                        (i, slice(start - i * c, stop - i * c), slice(start - low, stop - low))
                    )
                spans.append(span)
            for parts in itertools.product(*spans):
                coords = tuple(p[0] for p in parts)
                piece = (k, tuple(p[1] for p in parts), (row, *(p[2] for p in parts)))
                pieces.setdefault(coords, []).append(piece)
    return dict(sorted(pieces.items()))


def check_corners(corners: object, extents: Sequence[int], patch: Sequence[int]) -> np.ndarray:
    """An explicit list of corners, validated (ints, shape ``(n, d)``, every window inside
    the array, no repeats) and sorted to C order."""
    d = len(extents)
    array = np.asarray(corners)
    if array.ndim == 1 and d == 1:
        array = array[:, None]
    if array.ndim != 2 or array.shape[1] != d or not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(
            f"PatchSource(windows=...): give an int array of shape (n, {d}), one corner per "
            f"row over the patch dims in the array's axis order; got shape {array.shape}, "
            f"dtype {array.dtype}"
        )
    array = array.astype(np.int64)
    if len(array) == 0:
        raise ConfigError("PatchSource(windows=[]): give at least one window corner")
    high = np.asarray(extents, dtype=np.int64) - np.asarray(patch, dtype=np.int64)
    bad = ((array < 0) | (array > high)).any(axis=1)
    if bad.any():
        raise ConfigError(
            f"PatchSource(windows=...): the window at corner {array[bad][0].tolist()} does "
            f"not lie inside the array (corners must be 0 <= corner <= {high.tolist()} for a "
            f"patch of {list(patch)}); drop it or move it inside"
        )
    array = sort_corners(array)
    repeats = (np.diff(array, axis=0) == 0).all(axis=1)
    if repeats.any():
        raise ConfigError(
            f"PatchSource(windows=...): corner {array[1:][repeats][0].tolist()} is given "
            "twice; each window is one sample, list it once"
        )
    return array
