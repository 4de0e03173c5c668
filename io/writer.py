"""Write arrays to a zarr v3 group laid out for ZarrSource: whole samples per chunk.

Chunks span every dimension but the first, so reading a sample decodes exactly
one chunk, and a chunk is about ``chunk_mb`` MB so each read is worth its latency.
For spatial decomposition, ``spatial_chunks`` also splits each sample along chosen
axes, so a rank reading one region of a sample fetches only that region's chunks.
Every chunk is written, even one equal to the fill value (zarr skips those by
default), so ZarrSource can treat any absent chunk as an incomplete store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from dataflow.core.errors import ConfigError, DataError
from dataflow.io.checksums import check_compressor, checksummed_codecs
from dataflow.io.dataset_metadata import json_attrs, write_metadata
from dataflow.io.xarray_backing import check_complete


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


def to_zarr(
    path: str | Path,
    x: Any,
    y: Any = None,
    *,
    x_name: str = "x",
    y_name: str = "y",
    sample_dim: str | None = None,
    chunk_mb: float = 8.0,
    compressor: str | None = "zstd",
    zarr_format: int = 3,
    spatial_chunks: Mapping[int | str, int] | None = None,
) -> str | Path:
    """Write ``x`` (and ``y``) as arrays ``x_name`` (``y_name``) of a zarr v3 group at ``path``.

    ``x`` is a numpy array or torch tensor (samples along the first axis), or an
    ``xarray.Dataset``: then every data variable with dimension ``sample_dim`` is
    written under its own name, with its dimension names, chunked along
    ``sample_dim`` (read it back with ``ZarrSource(path, x=..., sample_dim=...)``).
    Dask-backed variables are written a slab at a time, never whole in memory.
    An existing zarr store at ``path`` is replaced; any other existing, non-empty
    directory is refused (so a wrong path never deletes unrelated files).
    ``compressor`` is "zstd", "blosc" (zstd inside blosc, with its byte shuffle), "lz4"
    (blosc's lz4 with its byte shuffle: it compresses floats a little less and decodes
    2.5x faster a thread than zstd, for fits whose GPU takes GB/s: a 4 x 128^3 sample
    read at 54 against 21 samples/s on one core), "gzip" or None; every chunk carries a checksum
    that each read verifies (``io.checksums``), so a chunk whose bytes changed on disk
    raises ``ChunkReadError`` instead of training on garbage. ``zarr_format`` is 3 (default)
    or 2, for tools that read only zarr v2; dimension names then go to the
    ``_ARRAY_DIMENSIONS`` attribute, as xarray writes them.

    ``spatial_chunks``: also chunk each sample, ``{axis: length}``, for spatial ranks
    that each read one region (``ZarrSource.region``). For arrays, axes count in one
    sample of ``x`` (0 the channels, 1 the first spatial axis) and ``y`` is not split;
    e.g. ``{1: D // 2}`` for two ranks along depth. For a Dataset, keys are dimension
    names, applied to every variable that has them. ``chunk_mb`` then sizes the
    chunks as split. Returns ``path``.
    """
    if zarr_format not in (2, 3):
        raise ConfigError(f"to_zarr(zarr_format={zarr_format!r}): use 3 (default) or 2")
    if not isinstance(chunk_mb, (int, float)) or not chunk_mb > 0:
        raise ConfigError(f"to_zarr(chunk_mb={chunk_mb!r}): must be a positive number, e.g. 8.0")
    check_compressor("to_zarr", compressor)
    if type(x).__name__ == "Dataset" and hasattr(x, "data_vars"):
        if y is not None:
            raise ConfigError("to_zarr(dataset, y): a Dataset carries its targets as variables")
        arrays = _dataset_arrays(x, sample_dim)
        splits = _dataset_splits(spatial_chunks, arrays, sample_dim)
    else:
        if y is not None and x_name == y_name:
            raise ConfigError(
                f"to_zarr: x_name and y_name are both {x_name!r}; give y another name"
            )
        arrays = {x_name: (_as_numpy("x", x), 0, None)}
        if y is not None:
            arrays[y_name] = (_as_numpy("y", y), 0, None)
            if len(arrays[y_name][0]) != len(arrays[x_name][0]):
                raise DataError(
                    f"to_zarr: x has {len(arrays[x_name][0])} samples but y has "
                    f"{len(arrays[y_name][0])}; both need the same length along their first "
                    "dimension"
                )
        splits = {x_name: _array_splits(spatial_chunks, arrays[x_name][0].shape)}
    group = _new_group(path, zarr_format, "to_zarr")
    for name, (array, axis, dims) in arrays.items():
        codecs = checksummed_codecs(compressor, zarr_format, np.dtype(array.dtype))
        attrs = json_attrs(x[name].attrs) if type(x).__name__ == "Dataset" else None
        _write_array(group, name, array, axis, dims, chunk_mb, codecs, splits.get(name, {}), attrs)
    if type(x).__name__ == "Dataset":  # what xarray needs to read it back as it was
        write_metadata(group, x, arrays, compressor)
    return path


def _new_group(path: str | Path, zarr_format: int, owner: str) -> zarr.Group:
    """A new zarr group at ``path``, replacing a zarr store there; any other existing,
    non-empty directory is refused (a wrong path never deletes unrelated files)."""
    target = Path(path)
    is_zarr = (target / "zarr.json").exists() or (target / ".zgroup").exists()
    if target.is_dir() and any(target.iterdir()) and not is_zarr:
        raise DataError(
            f"{owner}(path={str(path)!r}): a non-empty directory that is not a zarr store; "
            f"choose a new path ({owner} replaces only zarr stores)"
        )
    return zarr.open_group(str(path), mode="w", zarr_format=zarr_format)


def create_sample_array(
    path: str | Path,
    name: str,
    samples: int,
    sample_shape: tuple[int, ...],
    dtype: Any,
    *,
    chunk_mb: float = 8.0,
    compressor: str | None = "zstd",
    owner: str = "create_sample_array",
) -> int:
    """A new zarr group at ``path`` with an empty array ``name`` of ``samples`` samples of
    ``sample_shape``, laid out as :func:`to_zarr` lays out ``x`` (whole samples per chunk of
    about ``chunk_mb`` MB, checksummed, every chunk written even when it equals the fill
    value), for writers that fill it in parts (``Pipeline.predict``). Returns the samples
    per chunk: parts aligned to it never share a chunk."""
    if not isinstance(chunk_mb, (int, float)) or not chunk_mb > 0:
        raise ConfigError(f"{owner}(chunk_mb={chunk_mb!r}): must be a positive number, e.g. 8.0")
    dtype = np.dtype(dtype)
    group = _new_group(path, 3, owner)
    sample_bytes = max(1, math.prod(sample_shape) * dtype.itemsize)
    per_chunk = int(min(samples, max(1, (chunk_mb * 1e6) // sample_bytes)))
    filters, compressors = checksummed_codecs(compressor, 3, dtype)
    group.create_array(
        name,
        shape=(samples, *sample_shape),
        dtype=dtype,
        chunks=(per_chunk, *(max(1, d) for d in sample_shape)),
        filters=filters,
        compressors=compressors,
        config={"write_empty_chunks": True},
    )
    return per_chunk


def create_field_array(
    path: str | Path,
    name: str,
    shape: tuple[int, ...],
    rows_dim: int,
    *,
    dimension_names: tuple[str, ...] | None = None,
    chunk_mb: float = 8.0,
    compressor: str | None = "zstd",
    owner: str = "create_field_array",
) -> int:
    """A new zarr group at ``path`` with an empty float32 array ``name`` of ``shape`` (a
    field: channels first), chunked along dimension ``rows_dim`` only (about ``chunk_mb``
    MB a chunk, whole along the others), NaN where nothing is written, checksummed, every
    chunk written. Returns the rows per chunk: parts aligned to it never share a chunk
    (``Pipeline.predict(stitch=True)``)."""
    if not isinstance(chunk_mb, (int, float)) or not chunk_mb > 0:
        raise ConfigError(f"{owner}(chunk_mb={chunk_mb!r}): must be a positive number, e.g. 8.0")
    dtype = np.dtype(np.float32)
    group = _new_group(path, 3, owner)
    row_bytes = max(1, math.prod(shape) // max(1, shape[rows_dim]) * dtype.itemsize)
    rows = int(min(shape[rows_dim], max(1, (chunk_mb * 1e6) // row_bytes)))
    filters, compressors = checksummed_codecs(compressor, 3, dtype)
    chunks = tuple(rows if d == rows_dim else max(1, n) for d, n in enumerate(shape))
    group.create_array(
        name,
        shape=shape,
        dtype=dtype,
        chunks=chunks,
        filters=filters,
        compressors=compressors,
        fill_value=np.nan,
        dimension_names=dimension_names,
        config={"write_empty_chunks": True},
    )
    return rows


def _dataset_arrays(dataset: Any, sample_dim: str | None) -> dict[str, tuple[Any, int, Any]]:
    """The data variables of an xarray Dataset that have ``sample_dim``, validated."""
    dims = sorted(map(str, dataset.dims))
    if sample_dim is None or sample_dim not in dataset.dims:
        raise ConfigError(
            f"to_zarr(dataset, sample_dim={sample_dim!r}): name the dimension that indexes "
            f"samples, one of {dims}"
        )
    arrays = {}
    for name, variable in dataset.data_vars.items():
        if sample_dim not in variable.dims:
            continue
        dtype = np.dtype(variable.dtype)
        if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
            raise DataError(
                f"to_zarr: variable {name!r} has dtype {dtype}, which is not numeric; "
                f"convert it first, e.g. dataset[{name!r}].astype('float32')"
            )
        check_complete(variable, "to_zarr", "dataset", str(name))  # no fill value copied
        arrays[str(name)] = (variable.data, variable.dims.index(sample_dim), variable.dims)
    if not arrays:
        raise DataError(f"to_zarr: no data variable of the dataset has dimension {sample_dim!r}")
    return arrays


def _length(key: Any, length: Any, extent: int) -> int:
    if not isinstance(length, int) or isinstance(length, bool) or not 1 <= length <= extent:
        raise ConfigError(
            f"to_zarr(spatial_chunks={{{key!r}: {length!r}}}): the chunk length must be an int "
            f"in 1..{extent} (the extent of {key!r}), e.g. {max(1, extent // 2)} for two ranks"
        )
    return length


def _array_splits(spatial: Any, shape: tuple[int, ...]) -> dict[int, int]:
    """``spatial_chunks`` of an array input, as chunk lengths by axis of the stored x."""
    if spatial is None:
        return {}
    if not isinstance(spatial, Mapping):
        raise ConfigError(
            f"to_zarr(spatial_chunks={spatial!r}): give a dict {{axis: chunk length}}, e.g. "
            "{1: 32} to chunk the first spatial axis of each sample by 32"
        )
    sample = shape[1:]
    splits = {}
    for key, length in spatial.items():
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < len(sample):
            raise ConfigError(
                f"to_zarr(spatial_chunks={{{key!r}: ...}}): for arrays, keys are axes of one "
                f"sample of x, shape {sample} (0 is the channels, 1 the first spatial axis): "
                f"use 0..{len(sample) - 1}"
            )
        splits[key + 1] = _length(key, length, sample[key])
    return splits


def _dataset_splits(
    spatial: Any, arrays: dict[str, tuple[Any, int, Any]], sample_dim: Any
) -> dict[str, dict[int, int]]:
    """``spatial_chunks`` of a Dataset (by dimension name), per variable and axis."""
    if spatial is None:
        return {}
    dims = sorted({str(d) for _, _, names in arrays.values() for d in names} - {sample_dim})
    if not isinstance(spatial, Mapping) or not all(k in dims for k in spatial):
        raise ConfigError(
            f"to_zarr(dataset, spatial_chunks={spatial!r}): for a Dataset give "
            f"{{dimension name: chunk length}}, names from {dims} (not the sample dimension)"
        )
    splits: dict[str, dict[int, int]] = {}
    for name, (array, _, names) in arrays.items():
        for key, length in spatial.items():
            if key in names:
                axis = list(names).index(key)
                splits.setdefault(name, {})[axis] = _length(key, length, array.shape[axis])
    return splits


def _write_array(
    group: zarr.Group,
    name: str,
    array: Any,
    axis: int,
    dims: Any,
    chunk_mb: float,
    codecs: tuple[tuple[Any, ...], tuple[Any, ...]],
    splits: dict[int, int],
    attrs: Mapping[str, Any] | None = None,
) -> None:
    """Create ``name`` chunked along ``axis`` (and by ``splits`` within a sample), with
    the attributes ``attrs``; write ~64 MB slabs."""
    attrs = dict(attrs or {})
    shape = tuple(int(s) for s in array.shape)
    n = shape[axis]
    if n == 0:
        raise DataError(f"to_zarr: {name} has no samples along its sample dimension")
    itemsize = np.dtype(array.dtype).itemsize
    sample_bytes = max(1, math.prod(shape) * itemsize // n)
    part = [splits.get(i, max(1, d)) for i, d in enumerate(shape) if i != axis]
    part_bytes = max(1, math.prod(part) * itemsize)  # one sample's share of a chunk
    per_chunk = int(min(n, max(1, (chunk_mb * 1e6) // part_bytes)))
    chunks = tuple(
        per_chunk if i == axis else splits.get(i, max(1, d)) for i, d in enumerate(shape)
    )
    names = None if dims is None else [str(d) for d in dims]
    v2 = group.metadata.zarr_format == 2
    out = group.create_array(
        name,
        shape=shape,
        dtype=np.dtype(array.dtype),
        chunks=chunks,
        filters=codecs[0],
        compressors=codecs[1],
        dimension_names=None if v2 else names,
        attributes={**attrs, **({"_ARRAY_DIMENSIONS": names} if v2 and names else {})},
        # v2 readers (xarray) take a fill value as "missing" and would mask real zeros
        **({"fill_value": None} if v2 else {}),
        config={"write_empty_chunks": True},  # an absent chunk always means incomplete
    )
    step = per_chunk * max(1, int(64e6 // (per_chunk * sample_bytes)))
    for start in range(0, n, step):
        region: list[Any] = [slice(None)] * len(shape)
        region[axis] = slice(start, min(n, start + step))
        out[tuple(region)] = np.asarray(array[tuple(region)])
