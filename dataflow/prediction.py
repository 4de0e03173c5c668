"""A trained model's outputs on every sample of a source, written to zarr:
``Pipeline.predict``.

Samples are read and prepared as a fit's evaluation reads them (``stages.Evaluate``: a
chunked store chunk by chunk, missing chunks refused, the graph's deterministic
transforms applied) and run through the model in eval mode. The outputs go to one array
of a new zarr group, row ``i`` the output of sample ``i``, laid out as ``io.to_zarr``
lays out ``x``. On a ``distributed.Client`` each worker takes a contiguous share of whole
output chunks, so no two write the same chunk, and writes it itself: the outputs never
pass through the driver.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from dataflow.core.errors import ConfigError
from dataflow.evaluation import checked_samples, run_shares
from dataflow.io.writer import create_sample_array
from dataflow.runtime.replica_spec import resolve_device
from dataflow.stages.evaluate import Evaluate

__all__ = ["predict"]


def predict(
    model: torch.nn.Module,
    stage: Evaluate,
    out: str | Path,
    *,
    name: str = "prediction",
    client: Any = None,
    device: str = "auto",
    chunk_mb: float = 8.0,
) -> str:
    """Write ``model``'s output on every sample of ``stage.source`` (prepared by
    ``stage``) to array ``name`` of a new zarr group at ``out``; returns ``out``."""
    samples = checked_samples("predict", model, stage.source)
    first = _first_output(stage, model)
    per_chunk = create_sample_array(
        out, name, samples, first.shape[1:], first.dtype, chunk_mb=chunk_mb, owner="predict"
    )
    if client is None:
        written = [predict_share(stage, model, device, 0, samples, str(out), name)]
    else:
        written = run_shares(  # each share whole output chunks: no two write one
            client,
            "predict",
            predict_share,
            stage,
            model,
            device,
            samples,
            align=per_chunk,
            extra=(str(out), name),
        )
    if sum(written) != samples:  # (each share writes each of its samples once)
        raise RuntimeError(f"predict wrote {sum(written)} of {samples} samples (a bug)")
    return str(out)


def _first_output(stage: Evaluate, model: torch.nn.Module) -> np.ndarray:
    """The output of sample 0, in this process: its shape and dtype size the array."""
    scored = copy.deepcopy(model).cpu()
    with contextlib.closing(stage.outputs(scored, torch.device("cpu"), 0, 1)) as outputs:
        _, _, output = next(outputs)
    return _as_rows(output)


def _as_rows(output: Any) -> np.ndarray:
    if not isinstance(output, torch.Tensor):
        raise ConfigError(
            f"predict: the model returned {type(output).__name__}, not a tensor; predict "
            "writes one output tensor per sample (wrap the model to return the one to keep)"
        )
    if output.dtype in (torch.bfloat16, torch.float16):
        output = output.float()  # (numpy and zarr have no bfloat16)
    return output.detach().cpu().numpy()


def predict_share(
    stage: Evaluate,
    model: torch.nn.Module,
    device: str,
    lo: int,
    hi: int,
    out: str,
    name: str,
) -> int:
    """Samples ``[lo, hi)``: their outputs written to ``out``'s array ``name`` by a copy
    of ``model`` on ``device`` (run on a worker, or in the driver's process). Returns
    how many were written."""
    place = resolve_device(device, 0)
    scored = copy.deepcopy(model).to(place)
    array = zarr.open_group(out, mode="r+")[name]
    rows = RowWriter(array)
    with contextlib.closing(stage.outputs(scored, place, lo, hi)) as outputs:
        for indices, _, output in outputs:
            rows.add(np.asarray(indices), _as_rows(output))
    rows.flush()
    return rows.written


class RowWriter:
    """Writes outputs by sample index to a zarr array whose first axis is the samples:
    runs of consecutive samples are gathered and written a whole chunk at a time (a
    partial chunk written twice would be read, merged and written again); samples in
    any other order (a window source's units) are written where they belong."""

    def __init__(self, array: Any) -> None:
        self.array = array
        self.per_chunk = int(array.chunks[0])
        self.start: int | None = None  # the first sample of the gathered run
        self.parts: list[np.ndarray] = []
        self.gathered = 0
        self.written = 0

    def add(self, indices: np.ndarray, rows: np.ndarray) -> None:
        if len(indices) == 0:
            return
        consecutive = bool((np.diff(indices) == 1).all())
        if consecutive and (self.start is None or self.start + self.gathered == indices[0]):
            if self.start is None:
                self.start = int(indices[0])
            self.parts.append(rows)
            self.gathered += len(rows)
            self._write_whole_chunks()
            return
        self.flush()
        if consecutive:
            self.start, self.parts, self.gathered = int(indices[0]), [rows], len(rows)
            self._write_whole_chunks()
        else:
            self.array.oindex[indices] = rows
            self.written += len(indices)

    def _write_whole_chunks(self) -> None:
        """Write the gathered run up to its last chunk boundary; keep the rest."""
        end = self.start + self.gathered
        boundary = end - end % self.per_chunk
        if boundary <= self.start:
            return
        run = np.concatenate(self.parts)
        done = boundary - self.start
        self.array[self.start : boundary] = run[:done]
        self.written += done
        self.start, self.parts, self.gathered = boundary, [run[done:]], len(run) - done

    def flush(self) -> None:
        """Write what is gathered (the end of a share, or before samples out of order)."""
        if self.start is not None and self.gathered:
            run = np.concatenate(self.parts)
            self.array[self.start : self.start + self.gathered] = run
            self.written += self.gathered
        self.start, self.parts, self.gathered = None, [], 0
