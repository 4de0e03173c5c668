"""A source over arrays in a zarr store (format 2 or 3), read by sample index.

Reads are chunk-aware only in the small sense: the samples asked for are grouped
by chunk so each chunk is fetched and decoded once per ``read``. Which samples a
replica asks for (sharding, shuffle buffers) is decided elsewhere.

Never train on missing data: zarr returns the fill value for a chunk absent from
the store, so every chunk a read touches is checked first (ChunkMissingError),
and a chunk that fails to decode is named (ChunkReadError).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.core.sync import sync

from dataflow.errors import ChunkMissingError, ChunkReadError, DataError
from dataflow.stages.base import Batch


class VariableNotFoundError(DataError, KeyError):
    """``x`` or ``y`` names an array that is not in the zarr group."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


def _store_label(store: Any) -> str:
    if isinstance(store, (zarr.Array, zarr.Group)):
        return str(store.store_path)
    return str(store)


def _open(store: Any, storage_options: dict[str, Any] | None) -> zarr.Array | zarr.Group:
    """Open ``store`` read-only; a path, an fsspec URL, or an already opened array/group."""
    if isinstance(store, (zarr.Array, zarr.Group)):
        return store
    if isinstance(store, Path):
        store = str(store)
    if not isinstance(store, str):
        raise DataError(
            f"ZarrSource(store=...): got {type(store).__name__}; pass a path, an fsspec URL "
            "such as 'file:///data/x.zarr', or an opened zarr.Array / zarr.Group"
        )
    options = {} if storage_options is None else {"storage_options": storage_options}
    try:
        return zarr.open(store=store, mode="r", **options)
    except FileNotFoundError as exc:
        raise DataError(
            f"ZarrSource(store={store!r}): no zarr array or group there; check the path "
            "(write one with dataflow.io.to_zarr)"
        ) from exc


def _member(root: zarr.Array | zarr.Group, field: str, name: Any, label: str) -> zarr.Array:
    """The array ``name`` in the group ``root`` (validated: exists, numeric)."""
    if isinstance(root, zarr.Array):
        raise DataError(
            f"ZarrSource({field}={name!r}): store {label} is a single array, not a group; "
            f"open its group to name {field}, or pass {field}=None"
        )
    if not isinstance(name, str):
        raise DataError(f"ZarrSource({field}=...): must be an array name (str), got {name!r}")
    existing = sorted(root.array_keys())
    try:
        array = root[name]
    except KeyError:
        array = None
    if not isinstance(array, zarr.Array):
        raise VariableNotFoundError(
            f"ZarrSource({field}={name!r}): no array {name!r} in {label}; "
            f"the arrays there are {existing}"
        )
    return array


def _check_array(field: str, array: zarr.Array, sample_dim: int, label: str) -> int:
    """Validate dtype and ``sample_dim``; return the normalized sample dim."""
    dtype = np.dtype(array.dtype)
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
        raise DataError(
            f"ZarrSource({field}={array.path or '<array>'!r}) in {label} has dtype {dtype}, "
            "which is not numeric; rewrite it as numbers (e.g. with dataflow.io.to_zarr)"
        )
    ndim = array.ndim
    if not -ndim <= sample_dim < ndim or ndim == 0:
        raise DataError(
            f"ZarrSource(sample_dim={sample_dim}): out of range for {field} "
            f"({array.path or '<array>'!r}, shape {array.shape}); use 0..{ndim - 1}"
        )
    return sample_dim % ndim


def _chunk_key(array: zarr.Array, coords: tuple[int, ...]) -> str:
    """The store key of the storage object at ``coords`` (a chunk, or a shard if sharded)."""
    key = array.metadata.encode_chunk_key(coords)
    return f"{array.path}/{key}" if array.path else key


def missing_chunk_keys(array: zarr.Array, sample_dim: int, sample_chunks: list[int]) -> list[str]:
    """Keys of stored objects absent from the store among chunks ``sample_chunks`` (along
    ``sample_dim``, all chunks across the other dims).

    Why this and not ``array.nchunks_initialized``: that lists every key under the
    array (a full listing on object stores) and only counts. One ``store.exists(key)``
    per touched object, run concurrently, is cheap and names the missing key. The
    unit of storage is the shard when the array is sharded (a shard holds many chunks).
    """
    unit = array.shards or array.chunks
    grid = [range(math.ceil(s / c)) for s, c in zip(array.shape, unit, strict=True)]
    keys = []
    for c in sample_chunks:
        grid[sample_dim] = [c]
        keys.extend(_chunk_key(array, coords) for coords in itertools.product(*grid))
    store = array.store_path.store

    async def exists_all() -> list[bool]:
        return await asyncio.gather(*(store.exists(key) for key in keys))

    return [key for key, ok in zip(keys, sync(exists_all()), strict=True) if not ok]


def _to_tensor(block: np.ndarray) -> torch.Tensor:
    if not block.dtype.isnative:  # zarr v2 may store big-endian; torch needs native order
        block = block.astype(block.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(block))


class _Reader:
    """Reads samples of one array by index, one decode per storage object touched."""

    def __init__(self, field: str, array: zarr.Array, sample_dim: int) -> None:
        self.field = field
        self.array = array
        self.sample_dim = sample_dim
        self.name = array.path or "<array>"
        self.unit = (array.shards or array.chunks)[sample_dim]

    def _select(self, rows: Any) -> tuple[Any, ...]:
        selection: list[Any] = [slice(None)] * self.array.ndim
        selection[self.sample_dim] = rows
        return tuple(selection)

    def read(self, indices: np.ndarray) -> torch.Tensor:
        if len(indices) == 0:
            shape = list(self.array.shape)
            shape.pop(self.sample_dim)
            return _to_tensor(np.empty((0, *shape), dtype=self.array.dtype))
        unique, inverse = np.unique(indices, return_inverse=True)
        touched = np.unique(unique // self.unit).tolist()
        missing = missing_chunk_keys(self.array, self.sample_dim, touched)
        if missing:
            raise ChunkMissingError(
                f"ZarrSource: array {self.name!r} has no chunk {missing[0]!r} "
                f"({len(missing)} missing among those read); the store is incomplete, and "
                "zarr would return fill values instead. Re-write or re-copy the store (zarr "
                "skips all-fill-value chunks unless written with write_empty_chunks=True, "
                "as dataflow.io.to_zarr does)"
            )
        try:  # one orthogonal selection: zarr fetches each chunk once, concurrently
            block = self.array.get_orthogonal_selection(self._select(unique))
        except Exception as exc:
            self._raise_read_error(touched, exc)
        block = np.moveaxis(block, self.sample_dim, 0)[inverse.reshape(-1)]
        return _to_tensor(block)

    def _raise_read_error(self, touched: list[int], exc: Exception) -> None:
        """Re-read chunk by chunk to name the one that fails to decode."""
        unit = self.array.shards or self.array.chunks
        other = [range(math.ceil(s / c)) for s, c in zip(self.array.shape, unit, strict=True)]
        for c in touched:
            other[self.sample_dim] = [c]
            for coords in itertools.product(*other):
                region = tuple(
                    slice(i * u, min((i + 1) * u, s))
                    for i, u, s in zip(coords, unit, self.array.shape, strict=True)
                )
                try:
                    self.array[region]
                except Exception as chunk_exc:
                    raise ChunkReadError(
                        f"ZarrSource: chunk {_chunk_key(self.array, coords)!r} of array "
                        f"{self.name!r} could not be read or decoded ({chunk_exc}); the file "
                        "is corrupt or truncated: re-write or re-copy the store"
                    ) from chunk_exc
        raise ChunkReadError(
            f"ZarrSource: reading array {self.name!r} failed ({exc}); every chunk read alone "
            "succeeded, so the store may be changing underneath: retry, or re-copy it"
        ) from exc


class ZarrSource:
    """Samples along ``sample_dim`` of array ``x`` (and ``y``) of a zarr store.

    ``store``: a local path or fsspec URL to a group or array (``storage_options``
    go to fsspec), or an opened ``zarr.Group`` / ``zarr.Array`` (an array is ``x``
    itself). ``sample_dim`` applies to ``x`` and ``y`` alike and is moved to axis 0
    in each batch. Pickles by its open parameters and reopens lazily on a worker.
    """

    def __init__(
        self,
        store: Any,
        x: str | None = "x",
        y: str | None = None,
        *,
        sample_dim: int = 0,
        shuffle: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(sample_dim, int) or isinstance(sample_dim, bool):
            raise DataError(f"ZarrSource(sample_dim={sample_dim!r}): must be an int, e.g. 0")
        self.store = store
        self.x_name = x
        self.y_name = y
        self.sample_dim = sample_dim
        self.shuffle = bool(shuffle)
        self.storage_options = storage_options
        self._open()
        x_arr, y_arr = self._x.array, None if self._y is None else self._y.array
        self._num_samples = x_arr.shape[self._x.sample_dim]
        if y_arr is not None and y_arr.shape[self._y.sample_dim] != self._num_samples:
            raise DataError(
                f"ZarrSource: x ({self._x.name!r}) has {self._num_samples} samples but y "
                f"({self._y.name!r}) has {y_arr.shape[self._y.sample_dim]} along "
                f"sample_dim={sample_dim}; both need the same sample count"
            )
        if self._num_samples == 0:
            raise DataError(f"ZarrSource: x ({self._x.name!r}) has no samples along sample_dim")

    def _open(self) -> None:
        root = _open(self.store, self.storage_options)
        label = _store_label(self.store)
        if isinstance(root, zarr.Array):
            x_arr = root
        else:
            if self.x_name is None:
                raise DataError(
                    f"ZarrSource(x=None): store {label} is a group; name the input array, "
                    f"one of {sorted(root.array_keys())}"
                )
            x_arr = _member(root, "x", self.x_name, label)
        self._x = _Reader("x", x_arr, _check_array("x", x_arr, self.sample_dim, label))
        self._y = None
        if self.y_name is not None:
            y_arr = _member(root, "y", self.y_name, label)
            self._y = _Reader("y", y_arr, _check_array("y", y_arr, self.sample_dim, label))

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def chunk_samples(self) -> int:
        """Samples per chunk of ``x`` along the sample dim (per shard, if it is sharded:
        the unit of storage a read fetches and checks for existence)."""
        return self._readers()[0].unit

    def _readers(self) -> tuple[_Reader, _Reader | None]:
        if self._x is None:  # unpickled: reopen on first use
            self._open()
        return self._x, self._y

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices`` (in that order) as one batch, sample dim first."""
        x_reader, y_reader = self._readers()
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(index) and (index.min() < 0 or index.max() >= self._num_samples):
            raise DataError(
                f"ZarrSource.read: indices must lie in [0, {self._num_samples}); "
                f"got {index.min()}..{index.max()}"
            )
        x = x_reader.read(index)
        y = None if y_reader is None else y_reader.read(index)
        return Batch(x=x, y=y, size=len(index), indices=indices)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_x"] = state["_y"] = None  # open handles stay behind; reopened in read()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"ZarrSource({_store_label(self.store)!r}, x={self.x_name!r}, y={self.y_name!r}, "
            f"num_samples={self._num_samples}, shuffle={self.shuffle})"
        )
