"""``Pipeline.predict(source, model, out, stitch=True)``: a window source's outputs put
back into the field they were cut from.

A model that segments or regresses per cell returns, for each window of a
``PatchSource``, an output of the window's shape (its channels first). Stitched, cell
``c`` of the written field is the mean of the outputs of every window that covers ``c``
(overlapping windows averaged), or with ``blend="gaussian"`` their mean weighted by a
Gaussian over each window (sigma 1/8 of the patch per axis, as MONAI's sliding-window
inference weighs them): a window's centre counts more than its edges, where a padded
convolution sees least. A cell no window covers (a stride longer than the patch, or the
field's edge past the last window) is NaN, and counted.

A forecast source (``y_shift=``, ``y_patch=``: x at times ``t, t+1``, y at ``t+2``) is
stitched into y's field instead: each output goes where its window's y lies, so a tile
model's forecasts make one map per predicted time, whatever x folds into its channels.
An output of the window's own shape (a per-cell regression against y) is one channel.

The field is written chunked along one patch axis (the "rows"): the one with the most
window positions (:func:`share_axis`), so that a volume one window spans in depth is cut
across, not into slabs that every window touches. On a ``distributed.Client`` each
worker takes a contiguous share of whole row chunks and computes every window that
touches its rows, so no two workers write one chunk and no sum crosses the network: a
window over a share's edge is computed by both neighbours, each keeping its own rows of
it. A share is worked in parts of at most ``memory_mb`` of
sums, each part again with the windows that touch it. Decisions (which windows touch
which rows, where each output lands) are pure functions of the source's geometry.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from dataflow.core.errors import ConfigError
from dataflow.evaluation import checked_samples, run_shares
from dataflow.io.writer import create_field_array
from dataflow.runtime.replica_spec import resolve_device
from dataflow.stages.evaluate import Evaluate

__all__ = ["FieldLayout", "field_layout", "predict_field", "share_axis"]

DEFAULT_MEMORY_MB = 1024.0  # a share's sums held at once, per worker
BLENDS = ("mean", "gaussian")
GAUSSIAN_SIGMA = 0.125  # of the patch length, per patch axis
GAUSSIAN_FLOOR = 1e-3  # the smallest weight: an edge cell still counts where it is alone


@dataclass(frozen=True)
class FieldLayout:
    """Where each window's output lands in the field: the field's dims after the
    channels (x's axes not folded into the channels, whole), the position of each patch
    axis among them, the patch, and every window's corner (C order, as the samples)."""

    field: tuple[int, ...]
    patch_dims: tuple[int, ...]
    patch: tuple[int, ...]
    corners: np.ndarray
    window: tuple[int, ...] = ()  # a window's output cells: the field with the patch cut
    dimension_names: tuple[str, ...] | None = None
    # per cell of a window's output (its spatial dims), the weight of its value (None:
    # every cell 1, a plain mean)
    weights: np.ndarray | None = None
    share: int = 0  # the patch axis (of patch_dims) the writes and shares are cut along

    @property
    def rows_dim(self) -> int:
        """The field dim the writes and shares are cut along: patch axis ``share``."""
        return self.patch_dims[self.share]

    @property
    def rows(self) -> int:
        return self.field[self.rows_dim]

    def windows_touching(self, lo: int, hi: int) -> np.ndarray:
        """The windows (ascending indices) whose rows meet ``[lo, hi)``. Along the first
        patch axis they are one run: the corners are in C order, so their first
        coordinate never decreases."""
        starts, length = self.corners[:, self.share], self.patch[self.share]
        if self.share == 0:
            first = int(np.searchsorted(starts, lo - length + 1, side="left"))
            return np.arange(first, int(np.searchsorted(starts, hi, side="left")))
        return np.flatnonzero((starts > lo - length) & (starts < hi))

    def place(self, corner: np.ndarray, lo: int, hi: int) -> tuple[tuple, tuple] | None:
        """(field index, output index) of the window at ``corner`` within rows
        ``[lo, hi)`` (the field index relative to ``lo``), or None if it misses them."""
        field, out = [slice(None)] * len(self.field), [slice(None)] * len(self.field)
        for j, (dim, length) in enumerate(zip(self.patch_dims, self.patch, strict=True)):
            start, stop = int(corner[j]), int(corner[j]) + length
            if j == self.share:
                start, stop = max(start, lo), min(stop, hi)
                if start >= stop:
                    return None
                field[dim] = slice(start - lo, stop - lo)
                out[dim] = slice(start - int(corner[j]), stop - int(corner[j]))
            else:
                field[dim] = slice(start, stop)
        return tuple(field), tuple(out)


def share_axis(corners: np.ndarray) -> int:
    """The patch axis (column of ``corners``) to cut the field's writes and the workers'
    shares along: the one with the most distinct window starts, the first of those. A
    thin axis (a volume's depth that one window spans) would hand every share every
    window, each computed by every worker for a slab of its rows. Pure."""
    counts = [len(np.unique(corners[:, j])) for j in range(corners.shape[1])]
    return min(range(len(counts)), key=lambda j: (-counts[j], j))


def gaussian_weights(window: tuple[int, ...], patch_dims: tuple[int, ...]) -> np.ndarray:
    """A window's cell weights for ``blend="gaussian"``: along each patch dim a Gaussian
    centred on the window (sigma ``GAUSSIAN_SIGMA`` of its length, 1 at the centre, at
    least ``GAUSSIAN_FLOOR``), constant along the whole dims."""
    weights = np.ones((), dtype=np.float64)
    for dim, length in enumerate(window):
        axis = np.ones(length)
        if dim in patch_dims:
            offset = np.arange(length) - (length - 1) / 2
            axis = np.exp(-0.5 * (offset / (GAUSSIAN_SIGMA * length)) ** 2)
        weights = np.multiply.outer(weights, axis)
    return np.maximum(weights / weights.max(), GAUSSIAN_FLOOR)


def field_layout(source: Any, blend: str = "mean") -> FieldLayout:
    """The layout of ``source``'s field, or a ConfigError saying why its windows'
    outputs cannot be put back into one."""
    if blend not in BLENDS:
        raise ConfigError(
            f"predict(blend={blend!r}): 'mean' (every window's cells alike) or 'gaussian' "
            "(a window's centre weighs more than its edges)"
        )
    geometry = getattr(source, "geometry", None)
    if geometry is None or not hasattr(source, "corners"):
        raise ConfigError(
            f"predict(stitch=True): {type(source).__name__} has no windows to put back; "
            "stitching needs a dataflow.io.PatchSource (leave stitch=False to write one "
            "row per sample)"
        )
    if getattr(source, "_region", None) is not None:  # (RegionView: None when whole)
        raise ConfigError(
            "predict(stitch=True): the PatchSource is a region view (spatial decomposition); "
            "stitch the whole source"
        )
    if geometry.y_full is not None and (
        bool(np.any(geometry.y_shift)) or tuple(geometry.y_extent) != tuple(geometry.patch)
    ):
        return _forecast_layout(source, geometry, blend)
    folded = [a for a in geometry.axes if a in geometry.fold_axes]
    if folded:
        raise ConfigError(
            f"predict(stitch=True): patch axis {folded[0]} of x is folded into the channels "
            "(PatchSource(channels=...)), so the output has no such axis to put windows "
            "back along; stitch over axes the output keeps, or leave stitch=False"
        )
    unfolded = [a for a in range(len(geometry.shape)) if a not in geometry.fold_axes]
    dims = geometry.dims
    field = tuple(int(geometry.shape[a]) for a in unfolded)
    patch_dims = tuple(unfolded.index(a) for a in geometry.axes)
    patch = tuple(int(p) for p in geometry.patch)
    window = tuple(
        patch[patch_dims.index(d)] if d in patch_dims else n for d, n in enumerate(field)
    )
    corners = np.asarray(source.corners, dtype=np.int64)
    return FieldLayout(
        field=field,
        patch_dims=patch_dims,
        patch=patch,
        corners=corners,
        window=window,
        dimension_names=None if dims is None else ("channel", *(str(dims[a]) for a in unfolded)),
        weights=gaussian_weights(window, patch_dims) if blend == "gaussian" else None,
        share=share_axis(corners),
    )


def _forecast_layout(source: Any, geometry: Any, blend: str) -> FieldLayout:
    """A forecast (``y_shift=``, ``y_patch=``): each output goes back where its window's
    y lies, so the field is y's array (a forecast of the next step over the whole map,
    for every time a window predicts), whatever x folds into its channels."""
    axes = tuple(int(a) for a in geometry.y_axes)
    if list(axes) != sorted(axes):
        raise ConfigError(
            "predict(stitch=True): y's dims are not in x's order along the patch, so its "
            "windows cannot be put back in x's window order; predict rows (stitch=False)"
        )
    field = tuple(int(n) for n in geometry.y_full)
    window = tuple(int(n) for n in geometry.y_shape)
    shift = np.asarray(geometry.y_shift, dtype=np.int64)
    dims = geometry.dims  # y's names are x's where y has x's dims (a forecast of x's own)
    same = dims is not None and len(dims) == len(field) and axes == tuple(geometry.axes)
    corners = np.asarray(source.corners, dtype=np.int64) + shift[None]
    return FieldLayout(
        field=field,
        patch_dims=axes,
        patch=tuple(int(n) for n in geometry.y_extent),
        corners=corners,
        window=window,
        dimension_names=("channel", *map(str, dims)) if same else None,
        weights=gaussian_weights(window, axes) if blend == "gaussian" else None,
        share=share_axis(corners),
    )


def add_window(
    sums: np.ndarray,
    counts: np.ndarray,
    layout: FieldLayout,
    corner: np.ndarray,
    output: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """Add one window's ``output`` (channels first) to the sums of rows ``[lo, hi)``,
    and its cells' weights to ``counts`` (1 each without blend weights)."""
    placed = layout.place(corner, lo, hi)
    if placed is None:
        return
    field, out = placed
    if layout.weights is None:
        sums[(slice(None), *field)] += output[(slice(None), *out)]
        counts[field] += 1
        return
    weights = layout.weights[out]
    sums[(slice(None), *field)] += output[(slice(None), *out)] * weights
    counts[field] += weights


def averaged(sums: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int]:
    """The (weighted) mean output per cell (NaN where no window reached) and the
    uncovered cells."""
    with np.errstate(invalid="ignore", divide="ignore"):
        values = (sums / counts[None]).astype(np.float32)
    uncovered = counts == 0
    values[:, uncovered] = np.nan
    return values, int(uncovered.sum())


def _with_channels(layout: FieldLayout, output: Any) -> torch.Tensor:
    """The batch's outputs as ``(n, channels, *window)``, once checked to be window-shaped
    (an output of the window's own shape, as a per-cell regression against y returns,
    is one channel)."""
    if not isinstance(output, torch.Tensor):
        raise ConfigError(
            f"predict(stitch=True): the model returned {type(output).__name__}, not a "
            "tensor; return the one output to put back into the field"
        )
    window = layout.window
    if output.dim() == len(window) + 1 and tuple(output.shape[1:]) == window:
        return output.unsqueeze(1)
    if output.dim() != len(window) + 2 or tuple(output.shape[2:]) != window:
        raise ConfigError(
            f"predict(stitch=True): the model's output per window is "
            f"{tuple(output.shape[1:])}, but stitching needs (channels, *{window}) or "
            f"{window}: one value per cell of the window (a segmentation or per-cell "
            "regression); a model with another output (a class per window) predicts rows: "
            "leave stitch=False"
        )
    return output


def predict_field(
    model: torch.nn.Module,
    stage: Evaluate,
    out: str,
    *,
    name: str = "prediction",
    client: Any = None,
    device: str = "auto",
    chunk_mb: float = 8.0,
    memory_mb: float = DEFAULT_MEMORY_MB,
    blend: str = "mean",
) -> str:
    """Write the field of ``model``'s averaged window outputs on ``stage.source`` to array
    ``name`` of a new zarr group at ``out``; returns ``out``."""
    if not isinstance(memory_mb, (int, float)) or not memory_mb > 0:
        raise ConfigError(f"predict(memory_mb={memory_mb!r}): a positive number of MB")
    layout = field_layout(stage.source, blend)
    checked_samples("predict", model, stage.source)
    channels = _first_channels(stage, model, layout)
    shape = (channels, *layout.field)
    per_chunk = create_field_array(
        out,
        name,
        shape,
        1 + layout.rows_dim,
        dimension_names=layout.dimension_names,
        chunk_mb=chunk_mb,
        owner="predict",
    )
    cells_per_row = math.prod(layout.field) // max(1, layout.rows)
    row_bytes = cells_per_row * 8 * (channels + 1)  # float64 sums and weights
    part_rows = max(per_chunk, int(memory_mb * 1e6 // row_bytes) // per_chunk * per_chunk)
    args = (str(out), name, layout, part_rows)
    if client is None:
        found = [stitch_share(stage, model, device, 0, layout.rows, *args)]
    else:
        found = run_shares(  # shares of whole row chunks: no two workers write one
            client,
            "predict",
            stitch_share,
            stage,
            model,
            device,
            layout.rows,
            align=per_chunk,
            extra=args,
        )
    uncovered = sum(found)
    if uncovered:
        warnings.warn(
            f"predict(stitch=True): {uncovered} of {math.prod(layout.field)} cells of the "
            "field are covered by no window (a stride longer than the patch, the edge past "
            "the last window, windows= or a mask that leave them out, a forecast's first "
            "times) and hold NaN",
            RuntimeWarning,
            stacklevel=3,
        )
    return str(out)


def _first_channels(stage: Evaluate, model: torch.nn.Module, layout: FieldLayout) -> int:
    """The output channels, from window 0 in this process (its shape checked)."""
    scored = copy.deepcopy(model).cpu()
    with contextlib.closing(stage.outputs(scored, torch.device("cpu"), 0, 1)) as outputs:
        _, _, output = next(outputs)
    return int(_with_channels(layout, output).shape[1])


def stitch_share(
    stage: Evaluate,
    model: torch.nn.Module,
    device: str,
    lo: int,
    hi: int,
    out: str,
    name: str,
    layout: FieldLayout,
    part_rows: int,
) -> int:
    """Rows ``[lo, hi)`` of the field, part by part: every window touching a part run
    through a copy of ``model`` on ``device``, its rows of the output added, the part's
    mean written. Returns the cells no window covered."""
    place_on = resolve_device(device, 0)
    scored = copy.deepcopy(model).to(place_on)
    array = zarr.open_group(out, mode="r+")[name]
    uncovered = 0
    for start in range(lo, hi, part_rows):
        stop = min(hi, start + part_rows)
        rows = list(layout.field)
        rows[layout.rows_dim] = stop - start
        sums = None
        counts = np.zeros(rows, dtype=np.float64)  # (the weights summed per cell)
        windows = layout.windows_touching(start, stop)
        if len(windows):
            first, last = int(windows[0]), int(windows[-1]) + 1
            reading = stage.outputs(scored, place_on, first, last, only=windows)
            with contextlib.closing(reading) as outputs:
                for indices, _, output in outputs:
                    output = _with_channels(layout, output)
                    if sums is None:
                        sums = np.zeros((int(output.shape[1]), *rows), dtype=np.float64)
                    values = output.detach().float().cpu().numpy()
                    for k, index in enumerate(np.asarray(indices)):
                        corner = layout.corners[index]
                        add_window(sums, counts, layout, corner, values[k], start, stop)
        if sums is None:  # no window reaches these rows: they stay NaN (the fill value)
            uncovered += int(counts.size)
            continue
        values, missed = averaged(sums, counts)
        uncovered += missed
        where = [slice(None)] * (1 + len(layout.field))
        where[1 + layout.rows_dim] = slice(start, stop)
        array[tuple(where)] = values
    return uncovered
