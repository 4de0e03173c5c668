"""What a held-out batch is refused for, naming the sample: a NaN or inf in its
target, its input or the model's output (the held-out loss would be NaN), or a metric
that is not finite on finite outputs. Used by :class:`~dataflow.stages.evaluate.Evaluate`
as it scores and predicts; and, before a fit starts, the held-out set's chunks checked
to exist (:func:`check_held_out_chunks`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dataflow.core.errors import DataError
from dataflow.io.chunk_index import is_chunked

__all__ = ["check_finite", "check_held_out_chunks", "metric_error", "non_finite_inputs"]


def check_held_out_chunks(source: Any) -> None:
    """Raise ``ChunkMissingError`` naming the first stored object of the held-out
    ``source`` that is absent, before the fit starts: the evaluation's own check comes at
    the first epoch's end, after a whole epoch of training (hours on a large set). One
    concurrent existence check per object, on the driver; a source that is not chunked
    (in memory) has nothing to check."""
    if not is_chunked(source):
        return
    members = getattr(source, "chunk_members", None)
    chunks = len(members) if members is not None else len(source.chunk_bounds) - 1
    source.check_chunks(range(chunks))


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors of an output or a batch field (a tensor, a tuple, a dict)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() or value.is_complex() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _bad_rows(values: list[torch.Tensor], size: int) -> torch.Tensor:
    """Per sample (dimension 0): whether any of ``values`` is NaN or inf there."""
    bad = torch.zeros(size, dtype=torch.bool)
    for t in values:
        if t.ndim and t.shape[0] == size:
            bad |= ~torch.isfinite(t).reshape(size, -1).all(dim=1).cpu()
    return bad


def _named(indices: np.ndarray) -> str:
    """Held-out samples, as an error names them: a range, or the first few."""
    first, last = int(indices[0]), int(indices[-1])
    if len(indices) == 1:
        return str(first)
    if last - first + 1 == len(indices) and (np.diff(indices) == 1).all():
        return f"{first} to {last}"
    shown = ", ".join(str(int(i)) for i in indices[:5])
    return f"{shown}{', ...' if len(indices) > 5 else ''} ({len(indices)} samples)"


def non_finite_inputs(batches: list[Any]) -> str | None:
    """Where a training step that went non-finite holds NaN or inf in its data: the
    samples (their indices in the source) whose ``x`` or ``y`` does, in ``batches`` (the
    step's batches in graph order: as read, then as transformed), or None. Asked only
    once a step has failed, so it costs the steady steps nothing."""
    for position, batch in enumerate(batches):
        if batch.indices is None or not batch.size:
            continue
        bad_x = _bad_rows(_tensors(batch.x), batch.size)
        bad_y = _bad_rows(_tensors(batch.y), batch.size)
        rows = (bad_x | bad_y).nonzero().flatten().tolist()
        if not rows:
            continue
        fields = [f for f, bad in (("x", bad_x), ("y", bad_y)) if bad[rows].any()]
        where = "as read" if position == 0 else "after the transforms"
        samples = _named(np.asarray(batch.indices)[rows])
        return (
            f"the step's data holds NaN or inf ({' and '.join(fields)} {where}) in sample(s) "
            f"{samples} of the source: a masked or missing value (a CF _FillValue read as "
            "NaN, a gap in the record)? Fill or drop those samples, or give the model a mask "
            "(PatchSource(nan='mask'))"
        )
    return None


def check_finite(source: Any, indices: np.ndarray, batch: Any, output: Any) -> None:
    """Raise a DataError naming the first held-out sample whose model output or target is
    NaN or inf (the held-out loss would be NaN, and the other metrics scored on it). One
    ``isfinite`` over the batch's output and float targets; the sample is found only then.
    ``indices``: the batch's samples' indices in ``source``."""
    if all(bool(torch.isfinite(t).all()) for t in (*_tensors(output), *_tensors(batch.y))):
        return
    y_bad = _bad_rows(_tensors(batch.y), batch.size)
    rows = (_bad_rows(_tensors(output), batch.size) | y_bad).nonzero().flatten().tolist()
    rows = rows or [0]  # an output without a sample dimension: the batch's first
    index = int(indices[rows[0]])
    if y_bad[rows[0]]:
        cause = "its y holds NaN or inf"
    elif _bad_rows(_tensors(batch.x), batch.size)[rows[0]]:
        cause = "its x (as the model receives it) holds NaN or inf"
    else:
        cause = "the model's output for it is NaN or inf, though its x is finite"
    others = ""
    if len(rows) > 1:
        shown = ", ".join(str(int(indices[r])) for r in rows[1:6])
        others = (
            f" Other such samples of the same batch: {shown}{', ...' if len(rows) > 6 else ''}."
        )
    error = DataError(
        f"held-out sample {index} of eval_source {source!r}: {cause}, so the held-out loss "
        f"and metrics would be NaN; fix or drop sample {index} in the held-out data (the "
        f"finite samples: numpy.isfinite(x).reshape(len(x), -1).all(axis=1)).{others}"
    )
    error.index, error.source = index, repr(source)
    raise error


def metric_error(source: Any, key: str, value: float, indices: np.ndarray) -> DataError:
    error = DataError(
        f"metric {key!r} is {value} on held-out samples {_named(indices)} of "
        f"eval_source {source!r}, though the model's outputs and the targets there are "
        "finite: the metric is not finite on them (a division by zero, a log of 0?); make "
        "it finite on every batch"
    )
    error.index, error.source = int(indices[0]), repr(source)
    return error
