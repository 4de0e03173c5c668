"""The arrays a ``PatchSource`` cuts windows from, opened as ``ZarrSource`` opens them, and
read one box at a time.

A zarr array is read through the same machinery as ``ZarrSource``'s region reads: the
chunk decoder of ``io.zarr_decode`` on the calling thread (so the chunk reader's decode
threads decode that many boxes at once), or zarr's own read for layouts it does not know
(sharding), with a missing object raising ``ChunkMissingError`` and a corrupt one
``ChunkReadError`` naming it; ``missing`` asks the store whether each object a box
touches exists (``ZarrArrayReader.missing``). Any other array (numpy, dask, an xarray
variable not backed by zarr) is read with ``numpy.asarray``: it has no chunks to miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zarr

from dataflow.core.errors import DataError
from dataflow.io.array_readers import ZarrArrayReader, missing_chunk_error, native
from dataflow.io.fetch import is_remote
from dataflow.io.windows import box_chunks
from dataflow.io.zarr_decode import MissingObject, ObjectDecodeError
from dataflow.io.zarr_source import (
    VariableNotFoundError,
    _check_dtype,
    _dimension_names,
    _is_dask_array,
    _is_xarray_dataset,
    _label,
    _open_zarr,
    _zarr_backing,
)

E = TypeVar("E", bound=Exception)


def _is_data_array(value: Any) -> bool:
    return type(value).__name__ == "DataArray" and hasattr(value, "dims")


class _BoxObjects(ZarrArrayReader):
    """``ZarrArrayReader`` whose ``missing`` takes the stored objects' coordinates
    themselves (a box's, over every axis) instead of chunks along a sample dim."""

    def _grid(self, chunks: Sequence[Any]) -> list[tuple[int, ...]]:
        return [tuple(c) for c in chunks]


class PatchArray:
    """One array of a ``PatchSource`` (``field``: ``"x"``, ``"x[1]"``, ``"y"``, ``"mask"``)."""

    def __init__(self, field: str, name: str, array: Any, label: str) -> None:
        _check_dtype(field, name, array.dtype, label)
        self.field = field
        self.name = name
        self.label = label
        self.shape = tuple(int(s) for s in array.shape)
        self.dtype = np.dtype(array.dtype)
        self.dims = _dimension_names(array) if isinstance(array, zarr.Array) else None
        if self.dims is None:
            self.dims = tuple(getattr(array, "dims", ())) or None
        self.reader: _BoxObjects | None = None
        if isinstance(array, zarr.Array):
            self.reader = _BoxObjects(field, array, 0)
            self.reader.name = name
            self.unit: tuple[int, ...] | None = tuple(array.shards or array.chunks)
            self.array = array
            self.fill_value: Any = array.fill_value  # what a region never written reads as
        else:
            data = getattr(array, "data", array) if not isinstance(array, np.ndarray) else array
            self.array = data
            chunks = getattr(data, "chunks", None) if _is_dask_array(data) else None
            self.unit = tuple(int(c[0]) for c in chunks) if chunks else None
            self.fill_value = None

    def missing(self, boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        """Raise ``ChunkMissingError`` naming the first absent stored object any of the
        boxes ``(lo, hi)`` touches."""
        if self.reader is None or self.unit is None:
            return
        coords: set[tuple[int, ...]] = set()
        for lo, hi in boxes:
            coords.update(box_chunks(lo, hi, self.unit))
        absent = self.reader.missing(sorted(coords))
        if absent:
            raise _renamed(missing_chunk_error(self.reader, absent))

    @property
    def fetches_ahead(self) -> bool:
        """Whether reads of this array take objects fetched ahead (``io.fetch``): decoded
        here, from a remote store (``s3://``, ``gs://``, ``https://``)."""
        decoder = None if self.reader is None else self.reader.decoder
        return decoder is not None and is_remote(decoder.store)

    def fetch_plan(
        self, boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[tuple[Any, str, int]]:
        """``(store, key, decoded bytes)`` of each stored object that reads of ``boxes``
        (in that order, each object in the order the decode reads it) decode here from a
        remote store; none where nothing is fetched ahead."""
        if not self.fetches_ahead:
            return []
        decoder = self.reader.decoder
        nbytes = math.prod(decoder.chunks) * self.dtype.itemsize
        return [
            (decoder.store, decoder.key(coords), nbytes)
            for lo, hi in boxes
            for coords in box_chunks(lo, hi, decoder.chunks)
        ]

    def read_box(self, lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:
        """``array[lo:hi]`` over every axis, native byte order."""
        selection = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True))
        if self.reader is None:
            data = self.array[selection]
            if _is_dask_array(data):  # inside a Dask worker: never a nested distributed compute
                data = data.compute(scheduler="synchronous")
            return native(np.asarray(data))
        reader = self.reader
        if reader.decoder is not None:
            out = np.empty(
                [b - a for a, b in zip(lo, hi, strict=True)], self.dtype.newbyteorder("=")
            )
            try:
                return reader.decoder.read(selection, out)
            except MissingObject as exc:  # the store changed since the epoch's check
                raise _renamed(missing_chunk_error(reader, [exc.key])) from None
            except ObjectDecodeError as exc:
                raise _renamed(reader._decode_error(exc.key, exc.error)) from exc.error
        try:
            return native(np.asarray(self.array[selection]))
        except Exception:  # name the object that fails (zarr's own read: sharding)
            assert self.unit is not None
            for coords in box_chunks(lo, hi, self.unit):
                part = tuple(
                    slice(max(a, i * u), min(b, (i + 1) * u))
                    for i, u, a, b in zip(coords, self.unit, lo, hi, strict=True)
                )
                try:
                    self.array[part]
                except Exception as chunk_exc:
                    error = reader._decode_error(reader._key(coords), chunk_exc)
                    raise _renamed(error) from chunk_exc
            raise

    def read_all(self) -> np.ndarray:
        return self.read_box([0] * len(self.shape), self.shape)


def _renamed(error: E) -> E:
    """The reader's error (``ChunkMissingError``, ``ChunkReadError``) as this source's."""
    return type(error)(str(error).replace("ZarrSource:", "PatchSource:", 1))


def open_store(store: Any, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The opened store (a zarr group or array, an xarray Dataset, a dask array) and its
    label for messages; a path or URL is opened as ``ZarrSource`` opens it."""
    if isinstance(store, (str, Path)):
        return _open_zarr(store, storage_options), str(store)
    if isinstance(store, (zarr.Array, zarr.Group)) or _is_xarray_dataset(store):
        return store, _label(store)
    if _is_dask_array(store) or isinstance(store, np.ndarray) or _is_data_array(store):
        return store, f"{type(store).__name__}{tuple(store.shape)}"
    raise DataError(
        f"PatchSource(store=...): got {type(store).__name__}; pass a path, an fsspec URL such "
        "as 'file:///data/x.zarr', an opened zarr.Array / zarr.Group, an xarray.Dataset or "
        "DataArray, a dask.array or a numpy array"
    )


def raw_zarr(store: Any, names: list[str]) -> Any:
    """A zarr-backed xarray Dataset as its zarr store's path (read raw: chunk-aware, and
    missing chunks are caught), as ``ZarrSource`` reads it; anything else unchanged."""
    if _is_xarray_dataset(store):
        backing = _zarr_backing(store, names)
        if backing is not None:
            return backing
    return store


def is_single_array(store: Any) -> bool:
    return (
        isinstance(store, (zarr.Array, np.ndarray))
        or _is_dask_array(store)
        or _is_data_array(store)
    )


def open_member(store: Any, field: str, name: Any, label: str) -> PatchArray:
    """Array ``name`` of a group or Dataset (``field`` names the argument)."""
    if not isinstance(name, str):
        raise DataError(f"PatchSource({field}=...): must be an array name (str), got {name!r}")
    if _is_xarray_dataset(store):
        available = sorted(map(str, store.variables))
    else:
        available = sorted(store.array_keys())
    if name not in available:
        raise VariableNotFoundError(
            f"PatchSource({field}={name!r}): no array {name!r} in {label}; the arrays there "
            f"are {available}"
        )
    array = store.variables[name] if _is_xarray_dataset(store) else store[name]
    return PatchArray(field, name, array, label)


def open_single(store: Any, label: str) -> PatchArray:
    """The store that is one array (zarr, numpy, dask, an xarray DataArray) as x, named
    by its path in the store (a store's root array: by the store)."""
    name = getattr(store, "path", None) or getattr(store, "name", None)
    name = str(label if name in (None, "", "/") else name)
    return PatchArray("x", name, store, label)


def shared_reads(
    arrays: Sequence[PatchArray], boxes: Sequence[tuple[list[int], list[int]]]
) -> tuple[list[tuple[PatchArray, tuple[list[int], list[int]]]], list[int]]:
    """The boxes to read, one per distinct stored array (y cut from the same array as an
    x: one box holding both, decoded once), and which of them serves each array."""
    reads: list[tuple[PatchArray, tuple[list[int], list[int]]]] = []
    served: list[int] = []
    where: dict[str, int] = {}
    for array, (lo, hi) in zip(arrays, boxes, strict=True):
        k = where.get(array.name)
        if k is None:
            where[array.name] = len(reads)
            served.append(len(reads))
            reads.append((array, (list(lo), list(hi))))
            continue
        first, (a, b) = reads[k]
        lo2 = [min(x, y) for x, y in zip(a, lo, strict=True)]
        hi2 = [max(x, y) for x, y in zip(b, hi, strict=True)]
        reads[k] = (first, (lo2, hi2))
        served.append(k)
    return reads, served
