"""Write arrays to a zarr v3 group laid out for ZarrSource: whole samples per chunk.

Chunks span every dimension but the first, so reading a sample decodes exactly
one chunk, and a chunk is about ``chunk_mb`` MB so each read is worth its latency.
Every chunk is written, even one equal to the fill value (zarr skips those by
default), so ZarrSource can treat any absent chunk as an incomplete store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from dataflow.errors import ConfigError, DataError

_COMPRESSORS = {
    "zstd": lambda: ZstdCodec(level=3),
    "blosc": lambda: BloscCodec(cname="zstd", clevel=3),
    "gzip": lambda: GzipCodec(level=5),
}


def _as_numpy(name: str, array: Any) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    elif not isinstance(array, np.ndarray):
        raise DataError(
            f"to_zarr: {name} must be a numpy array or a torch tensor, "
            f"got {type(array).__name__}; wrap it with numpy.asarray({name})"
        )
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise DataError(
            f"to_zarr: {name} has dtype {array.dtype}, which is not numeric; "
            f"convert it first, e.g. {name}.astype('float32')"
        )
    if array.ndim == 0 or len(array) == 0:
        raise DataError(f"to_zarr: {name} has no samples (it needs a non-empty first dimension)")
    return array


def samples_per_chunk(array: np.ndarray, chunk_mb: float) -> int:
    """Whole samples per chunk so a chunk is about ``chunk_mb`` MB (at least 1)."""
    sample_bytes = max(1, array[:1].nbytes)
    return int(min(len(array), max(1, (chunk_mb * 1e6) // sample_bytes)))


def to_zarr(
    path: str | Path,
    x: Any,
    y: Any = None,
    *,
    x_name: str = "x",
    y_name: str = "y",
    chunk_mb: float = 8.0,
    compressor: str | None = "zstd",
) -> str | Path:
    """Write ``x`` (and ``y``) as arrays ``x_name`` (``y_name``) of a zarr v3 group at ``path``.

    An existing zarr store at ``path`` is replaced; any other existing, non-empty
    directory is refused (so a wrong path never deletes unrelated files).
    ``compressor`` is "zstd", "blosc", "gzip" or None. Returns ``path``.
    """
    if not isinstance(chunk_mb, (int, float)) or not chunk_mb > 0:
        raise ConfigError(f"to_zarr(chunk_mb={chunk_mb!r}): must be a positive number, e.g. 8.0")
    if compressor is not None and compressor not in _COMPRESSORS:
        raise ConfigError(
            f"to_zarr(compressor={compressor!r}): use one of {sorted(_COMPRESSORS)} or None"
        )
    if y is not None and x_name == y_name:
        raise ConfigError(f"to_zarr: x_name and y_name are both {x_name!r}; give y another name")
    arrays = {x_name: _as_numpy("x", x)}
    if y is not None:
        arrays[y_name] = _as_numpy("y", y)
        if len(arrays[y_name]) != len(arrays[x_name]):
            raise DataError(
                f"to_zarr: x has {len(arrays[x_name])} samples but y has "
                f"{len(arrays[y_name])}; both need the same length along their first dimension"
            )
    target = Path(path)
    is_zarr = (target / "zarr.json").exists() or (target / ".zgroup").exists()
    if target.is_dir() and any(target.iterdir()) and not is_zarr:
        raise DataError(
            f"to_zarr(path={str(path)!r}): a non-empty directory that is not a zarr store; "
            "choose a new path (to_zarr replaces only zarr stores)"
        )
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    codecs = () if compressor is None else (_COMPRESSORS[compressor](),)
    for name, array in arrays.items():
        chunks = (samples_per_chunk(array, chunk_mb), *(max(1, d) for d in array.shape[1:]))
        out = group.create_array(
            name,
            shape=array.shape,
            dtype=array.dtype,
            chunks=chunks,
            compressors=codecs,
            config={"write_empty_chunks": True},  # an absent chunk always means incomplete
        )
        out[...] = array
    return path
