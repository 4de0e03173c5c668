"""What a ``PatchSource`` does with NaN in its windows: refuse them naming the window
(``nan="refuse"``, and always for y), or read them as 0 with a validity channel
(``nan="mask"``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dataflow.core.errors import DataError
from dataflow.io.patch_arrays import PatchArray

NAN_MODES = ("refuse", "mask")


def refuse_nan(
    array: PatchArray,
    cut: np.ndarray,
    members: np.ndarray,
    corner: Callable[[int], dict[Any, int]],
) -> None:
    """Raise ``DataError`` naming the first window of ``cut`` (the windows ``members``
    of ``array``; ``corner``: a window's corner by dim) holding NaN (one ``isnan`` over
    the windows; integer arrays hold none)."""
    if not np.issubdtype(cut.dtype, np.floating) or not np.isnan(cut).any():
        return
    k = int(np.flatnonzero(np.isnan(cut.reshape(len(cut), -1)).any(axis=1))[0])
    index = int(members[k])
    fill = array.fill_value
    unwritten = (
        f"; NaN is also {array.name!r}'s fill value, what a region never written reads as"
        if isinstance(fill, (float, np.floating)) and np.isnan(fill)
        else ""
    )
    fix = (
        "fill or drop those values in the store"
        if array.field == "y"
        else "pass nan='mask' (NaN read as 0, a channel appended to x: 1 where valid), "
        "drop such windows with mask= (True where valid), or fill the store"
    )
    raise DataError(
        f"PatchSource: window {index} (corner {corner(index)}) of {array.field} "
        f"({array.name!r}) holds NaN{unwritten}; {fix}"
    )


def masked_nan(x: np.ndarray) -> np.ndarray:
    """``(n, C, ...)`` -> ``(n, C + 1, ...)``: NaN read as 0, then a channel that is 1
    where every channel of the cell is valid (0 where any is NaN)."""
    if not np.issubdtype(x.dtype, np.floating):
        return np.concatenate([x, np.ones_like(x[:, :1])], axis=1)
    bad = np.isnan(x)
    valid = ~bad.any(axis=1, keepdims=True)
    x = np.where(bad, x.dtype.type(0), x)
    return np.concatenate([x, valid.astype(x.dtype)], axis=1)
