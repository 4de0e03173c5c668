"""PatchSource beyond its windows: the gather that cuts them, object stores, resume,
NaN, normalisation."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.io.windows import cut_windows


def sliced(region, lo, corners, extent, axes) -> np.ndarray:
    """The windows cut one by one with slicing (what ``cut_windows`` must equal)."""
    out = []
    for corner in corners:
        index = [slice(None)] * region.ndim
        for c, e, axis in zip(corner, extent, axes, strict=True):
            index[axis] = slice(c - lo[axis], c - lo[axis] + e)
        out.append(region[tuple(index)])
    return np.stack(out)


@pytest.mark.parametrize(
    ("shape", "extent", "axes"),
    [
        ((30, 20), (4, 5), (0, 1)),
        ((3, 30, 20), (4, 5), (1, 2)),  # a whole leading axis (levels)
        ((30, 3, 20, 2), (6, 5), (0, 2)),  # whole axes between and after the cut ones
        ((12, 10, 9), (3, 3, 3), (0, 1, 2)),
        ((50,), (1,), (0,)),
    ],
)
def test_windows_are_cut_in_one_gather_exactly_as_slicing_cuts_them(shape, extent, axes):
    rng = np.random.default_rng(len(shape))
    region = rng.normal(size=shape).astype(np.float32)
    lo = [0] * len(shape)
    for axis in axes:
        lo[axis] = 7  # the box was read from corner 7 of the array
    high = [shape[a] - e + 7 for a, e in zip(axes, extent, strict=True)]
    corners = np.stack([rng.integers(7, h + 1, 40) for h in high], axis=1)
    got = cut_windows(region, lo, corners, extent, axes)
    assert got.flags.c_contiguous and got.flags.writeable
    assert np.array_equal(got, sliced(region, lo, corners, extent, axes))
    # a strided region (a numpy or dask array's box may not be contiguous)
    odd = np.asfortranarray(region)
    assert np.array_equal(cut_windows(odd, lo, corners, extent, axes), got)
