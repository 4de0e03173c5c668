"""The arrays a ``PatchSource`` cuts windows from, opened as ``ZarrSource`` opens them, and
read a unit of windows at a time.

A zarr array is read through the same machinery as ``ZarrSource``'s region reads: the
chunk decoder of ``io.zarr_decode`` on the calling thread (so the chunk reader's decode
threads decode that many units at once), which hands each storage chunk the windows
touch to :meth:`PatchArray.read_windows` to copy their parts straight into the windows
(no bounding box), or zarr's own read of the windows' bounding box for layouts it does
not know (sharding), with a missing object raising ``ChunkMissingError`` and a corrupt one
``ChunkReadError`` naming it; ``missing`` asks the store whether each object a read
decodes exists (``ZarrArrayReader.missing``). An xarray variable or dask array that is a
box of a zarr array (all of it, or a split: ``ds.sel(time=slice("1990", "2010"))``,
``io.xarray_slices``) is that zarr array read raw from the box's origin: every window,
chunk list, fetch plan and cut is moved by it here, so the source sees the box alone.
Any other array (numpy, dask, an xarray variable not backed by zarr, or one CF-unpacked
or sliced with a step) is read with ``numpy.asarray``: through xarray, checked whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zarr

from dataflow.core.errors import DataError
from dataflow.io.array_readers import ZarrArrayReader, native
from dataflow.io.box_map import BoxMap
from dataflow.io.fetch import is_remote
from dataflow.io.read_errors import missing_chunk_error
from dataflow.io.region import chunk_range
from dataflow.io.windows import box_chunks, cut_windows, window_chunks, window_pieces
from dataflow.io.xarray_adapters import (
    is_dask_array,
    is_data_array,
    is_xarray_dataset,
    may_read_zarr,
)
from dataflow.io.xarray_backing import check_complete
from dataflow.io.xarray_slices import ZarrBox, ZarrSplit, decoded, zarr_box
from dataflow.io.zarr_decode import MissingObject, ObjectDecodeError
from dataflow.io.zarr_source import (
    VariableNotFoundError,
    _check_dtype,
    _dimension_names,
    _label,
    _open_zarr,
)

E = TypeVar("E", bound=Exception)
Window = tuple[np.ndarray, tuple[int, ...]]  # windows' low corners (n, ndim) and shape


class _BoxObjects(ZarrArrayReader):
    """``ZarrArrayReader`` whose ``missing`` takes the stored objects' coordinates
    themselves (a box's, over every axis) instead of chunks along a sample dim."""

    def _grid(self, chunks: Sequence[Any]) -> list[tuple[int, ...]]:
        return [tuple(c) for c in chunks]


class PatchArray:
    """One array of a ``PatchSource`` (``field``: ``"x"``, ``"x[1]"``, ``"y"``, ``"mask"``)."""

    def __init__(
        self, field: str, name: str, array: Any, label: str, check_xarray: bool = True
    ) -> None:
        _check_dtype(field, name, array.dtype, label)
        self.field = field
        self.name = name
        self.label = label
        self.shape = tuple(int(s) for s in array.shape)
        self.dtype = np.dtype(array.dtype)
        self.dims = _dimension_names(array) if isinstance(array, zarr.Array) else None
        if self.dims is None:
            self.dims = tuple(getattr(array, "dims", None) or ()) or None
        # where this array lies in the zarr array read (a box of it: a split made in xarray)
        self.box = BoxMap.identity(len(self.shape))
        box = array if isinstance(array, ZarrBox) else None  # traced on the driver
        if box is None and may_read_zarr(array):
            box = zarr_box(array)
        self.decode: tuple[Any, ...] = ()  # xarray's CF decoding (io.xarray_slices.decoded)
        if box is not None:
            array, self.box, self.decode = box.array, BoxMap(box.lo, box.dropped), box.decode
        self.reader: _BoxObjects | None = None
        self._stored_unit: tuple[int, ...] | None = None  # (over the stored array's axes)
        if isinstance(array, zarr.Array):
            self.reader = _BoxObjects(field, array, 0)
            self.reader.name = name
            self._stored_unit = tuple(array.shards or array.chunks)
            self.unit: tuple[int, ...] | None = self.box.seen(self._stored_unit)
            self.array = array
            self.fill_value: Any = array.fill_value  # what a region never written reads as
        else:
            if check_xarray and may_read_zarr(array):  # xarray or dask: checked whole
                check_complete(array, "PatchSource", field, name)
            data = getattr(array, "data", array) if not isinstance(array, np.ndarray) else array
            self.array = data
            chunks = getattr(data, "chunks", None) if is_dask_array(data) else None
            self.unit = tuple(int(c[0]) for c in chunks) if chunks else None
            self.fill_value = None

    def missing(self, objects: Sequence[tuple[int, ...]]) -> None:
        """Raise ``ChunkMissingError`` naming the first absent stored object among
        ``objects`` (coordinates on the grid of :attr:`unit`, as :meth:`objects` lists)."""
        if self.reader is None or self.unit is None:
            return
        absent = self.reader.missing(sorted(set(objects)))
        if absent:
            raise _renamed(missing_chunk_error(self.reader, absent))

    @property
    def cuts_direct(self) -> bool:
        """Whether windows are cut straight from the decoded storage chunks
        (:meth:`read_windows`): a zarr array decoded here (``io.zarr_decode``)."""
        return self.reader is not None and self.reader.decoder is not None

    def cuts_from_chunks(self, windows: Sequence[Window]) -> bool:
        """Whether ``windows`` are cut straight from the decoded chunks: where
        :attr:`cuts_direct` and they hold no more cells than their bounding box. Windows
        that overlap more than that (tiles x time: each cell in several windows) are cut
        from the box in one numpy gather instead: fewer Python steps per window, and the
        box's extra copy is smaller than the windows."""
        if not self.cuts_direct:
            return False
        lo, hi = enclosing(windows)
        cells = sum(len(los) * math.prod(shape) for los, shape in windows)
        return cells <= math.prod(b - a for a, b in zip(lo, hi, strict=True))

    def objects(self, windows: Sequence[Window]) -> list[tuple[int, ...]]:
        """The stored objects (coordinates on the grid of :attr:`unit`, C order) that a
        read of ``windows`` decodes: the chunks the windows touch when cut directly,
        else every object of their bounding box (none: no stored objects)."""
        unit = self._stored_unit
        if unit is None:
            return []
        if self.cuts_from_chunks(windows):
            touched: set[tuple[int, ...]] = set()
            for los, shape in windows:
                touched |= window_chunks(self.box.corners(los), self.box.shape(shape), unit)
            return sorted(touched)
        return box_chunks(*self.box.box(*enclosing(windows)), unit)

    @property
    def decoded_bytes(self) -> int:
        """The bytes of every stored chunk this array reads, decoded: its own where it is
        the whole stored array, more for a split (a chunk holds cells outside it, and all
        the levels of one level taken)."""
        own = math.prod(self.shape) * self.dtype.itemsize
        unit = self._stored_unit
        if unit is None or not self.box.moves:
            return own
        lo, hi = self.box.box([0] * len(self.shape), self.shape)
        chunks = math.prod(len(chunk_range(a, b, u)) for a, b, u in zip(lo, hi, unit, strict=True))
        return chunks * math.prod(unit) * np.dtype(self.array.dtype).itemsize

    @property
    def origin(self) -> tuple[int, ...]:
        """Where this array's cell 0 is in the zarr array read (a split of it), per axis."""
        return self.box.origin

    @property
    def where(self) -> tuple[int, ...] | None:
        """The low corner of the box of the stored array read, over the stored axes
        (an axis taken at one index: that index); None where all of it is read."""
        return self.box.lo if self.box.moves else None

    @property
    def fetches_ahead(self) -> bool:
        """Whether reads of this array take objects fetched ahead (``io.fetch``): decoded
        here, from a remote store (``s3://``, ``gs://``, ``https://``)."""
        decoder = None if self.reader is None else self.reader.decoder
        return decoder is not None and is_remote(decoder.store)

    def fetch_plan(self, objects: Sequence[tuple[int, ...]]) -> list[tuple[Any, str, int]]:
        """``(store, key, decoded bytes)`` of each of ``objects`` (in that order: the order
        the reads decode them) where they are decoded here from a remote store; none
        where nothing is fetched ahead."""
        if not self.fetches_ahead:
            return []
        decoder = self.reader.decoder
        nbytes = math.prod(decoder.chunks) * np.dtype(self.array.dtype).itemsize
        return [(decoder.store, decoder.key(coords), nbytes) for coords in objects]

    def read_windows(self, cuts: Sequence[tuple[np.ndarray, Sequence[int], np.ndarray]]) -> None:
        """Each window of each cut ``(los, shape, out)`` (low corners ``(n, ndim)`` over
        every axis) straight from the decoded storage chunks it overlaps into its row of
        ``out``: one copy per window byte and no bounding box, each chunk taken once for
        all the cuts (x and y of one array). Only where :attr:`cuts_direct`."""
        decoder = self.reader.decoder
        windows = [(self.box.corners(los), self.box.shape(shape)) for los, shape, _ in cuts]
        pieces = window_pieces(windows, decoder.chunks)
        outs = [self.box.rows(out) for *_, out in cuts]  # (over the stored axes)

        decode = self.decode  # (CF-packed: each piece unpacked as xarray unpacks it)

        def take(coords: tuple[int, ...], chunk: np.ndarray) -> None:
            for k, source, target in pieces[coords]:
                outs[k][target] = decoded(decode, chunk[source]) if decode else chunk[source]

        with self._named_errors():
            decoder.visit(list(pieces), take)

    @contextlib.contextmanager
    def _named_errors(self) -> Iterator[None]:
        """The decoder's errors as ``ChunkMissingError`` / ``ChunkReadError`` naming the
        object (a missing one: the store changed since the epoch's check)."""
        reader = self.reader
        try:
            yield
        except MissingObject as exc:
            raise _renamed(missing_chunk_error(reader, [exc.key])) from None
        except ObjectDecodeError as exc:
            raise _renamed(reader._decode_error(exc.key, exc.error)) from exc.error

    def read_box(self, lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:
        """``array[lo:hi]`` over every axis, native byte order."""
        block = self.box.squeeze(self._read_stored(*self.box.box(lo, hi)))
        return decoded(self.decode, block) if self.decode else block

    def _read_stored(self, lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:
        """``array[lo:hi]`` over every axis of the array read (the stored one)."""
        selection = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True))
        if self.reader is None:
            data = self.array[selection]
            if is_dask_array(data):  # inside a Dask worker: never a nested distributed compute
                data = data.compute(scheduler="synchronous")
            return native(np.asarray(data))
        reader = self.reader
        if reader.decoder is not None:
            out = np.empty(
                [b - a for a, b in zip(lo, hi, strict=True)],
                np.dtype(self.array.dtype).newbyteorder("="),
            )
            with self._named_errors():
                return reader.decoder.read(selection, out)
        try:
            return native(np.asarray(reader.retry.run(lambda: self.array[selection])))
        except Exception as exc:  # name the object that fails (zarr's own read: sharding)
            unit = self._stored_unit
            assert unit is not None
            objects = box_chunks(lo, hi, unit)
            reader._raise_if_refused(reader._key(objects[0]), exc, "PatchSource")
            for coords in objects:
                part = tuple(
                    slice(max(a, i * u), min(b, (i + 1) * u))
                    for i, u, a, b in zip(coords, unit, lo, hi, strict=True)
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
        return _open_zarr(store, storage_options, "PatchSource"), str(store)
    if isinstance(store, (zarr.Array, zarr.Group, ZarrSplit, ZarrBox)):
        return store, _label(store)
    if is_xarray_dataset(store):
        return store, _label(store)
    if is_dask_array(store) or isinstance(store, np.ndarray) or is_data_array(store):
        return store, f"{type(store).__name__}{tuple(store.shape)}"
    raise DataError(
        f"PatchSource(store=...): got {type(store).__name__}; pass a path, an fsspec URL such "
        "as 'file:///data/x.zarr', an opened zarr.Array / zarr.Group, an xarray.Dataset or "
        "DataArray, a dask.array or a numpy array"
    )


def is_single_array(store: Any) -> bool:
    return (
        isinstance(store, (zarr.Array, np.ndarray, ZarrBox))
        or is_dask_array(store)
        or is_data_array(store)
    )


def open_member(
    store: Any,
    field: str,
    name: Any,
    label: str,
    check_xarray: bool = True,
    caller: str = "PatchSource",
) -> PatchArray:
    """Array ``name`` of a group or Dataset (``caller``'s argument ``field``);
    ``check_xarray``: xarray data's zarr arrays checked whole (once, on the driver)."""
    if not isinstance(name, str):
        raise DataError(f"{caller}({field}=...): must be an array name (str), got {name!r}")
    if is_xarray_dataset(store):
        available = sorted(map(str, store.variables))
    elif isinstance(store, ZarrSplit):
        available = sorted(store.boxes)
    else:
        available = sorted(store.array_keys())
    if name not in available:
        raise VariableNotFoundError(
            f"{caller}({field}={name!r}): no array {name!r} in {label}; the arrays there "
            f"are {available}"
        )
    if isinstance(store, ZarrSplit):
        array = store.boxes[name]
    else:
        array = store.variables[name] if is_xarray_dataset(store) else store[name]
    return PatchArray(field, name, array, label, check_xarray)


def open_single(store: Any, label: str, check_xarray: bool = True) -> PatchArray:
    """The store that is one array (zarr, numpy, dask, an xarray DataArray) as x, named
    by its path in the store (a store's root array: by the store)."""
    name = getattr(store, "path", None) or getattr(store, "name", None)
    name = str(label if name in (None, "", "/") else name)
    return PatchArray("x", name, store, label, check_xarray)


def enclosing(windows: Sequence[Window]) -> tuple[list[int], list[int]]:
    """``(lo, hi)`` over every axis: the box holding all of ``windows``."""
    lows = np.concatenate([los for los, _ in windows])
    highs = np.concatenate([los + np.asarray(shape, np.int64) for los, shape in windows])
    return lows.min(axis=0).tolist(), highs.max(axis=0).tolist()


def stored_arrays(arrays: Sequence[PatchArray]) -> list[list[int]]:
    """The arrays grouped by the stored array they read (y cut from the same array as
    an x: one group, its chunks read once for both), in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for k, array in enumerate(arrays):
        groups.setdefault(array.name, []).append(k)
    return list(groups.values())


def read_windows(
    arrays: Sequence[PatchArray], windows: Sequence[Window], outs: Sequence[np.ndarray | None]
) -> list[np.ndarray]:
    """Each array's ``windows`` stacked ``(n, *shape)``, into ``outs[k]`` where given,
    reading each stored array once: straight from the decoded chunks where
    :meth:`PatchArray.cuts_from_chunks` (:meth:`PatchArray.read_windows`), else one
    bounding box of all its windows read (:meth:`PatchArray.read_box`) and the windows
    cut from it."""
    result = list(outs)
    for group in stored_arrays(arrays):
        array = arrays[group[0]]
        native_dtype = array.dtype.newbyteorder("=")
        if array.cuts_from_chunks([windows[k] for k in group]):
            for k in group:
                if result[k] is None:
                    result[k] = np.empty((len(windows[k][0]), *windows[k][1]), native_dtype)
            array.read_windows([(*windows[k], result[k]) for k in group])
            continue
        lo, hi = enclosing([windows[k] for k in group])
        box = array.read_box(lo, hi)
        for k in group:
            los, shape = windows[k]
            cut = cut_windows(box, lo, los, shape, range(len(shape)))
            if result[k] is None:
                result[k] = cut
            else:
                result[k][...] = cut
    return result  # type: ignore[return-value]
