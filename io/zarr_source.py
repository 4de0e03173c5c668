"""A source over chunked arrays: a zarr store (format 2 or 3), an xarray Dataset or dask arrays.

Accepted ``store`` values: a local path or an fsspec URL (``file://``, ``memory://``,
``s3://`` with ``storage_options``) to a zarr group or array; an opened
``zarr.Group`` / ``zarr.Array``; an ``xarray.Dataset`` (variables by name, the
sample dimension by name); a ``dask.array.Array``. An xarray Dataset opened from
a zarr store (``xarray.open_zarr``) is read from that store directly, so missing
chunks are caught; one holding dask or numpy data is read through those.

The source is chunk-aware (``chunk_bounds``, ``check_chunks``, ``read_chunks``):
``io.chunk_reader`` decodes every chunk once per epoch. Never train on missing
data: zarr returns the fill value for a chunk absent from the store, so every
chunk an epoch reads is checked to exist first (``ChunkMissingError``), and a
chunk that fails to decode is named (``ChunkReadError``).

Spatial decomposition: ``source.region({axis: (lo, hi)})`` is a view that reads
only that region of every sample's inputs (``io.region``), fetching only the chunks
the region intersects and checking exactly those exist.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from dataflow.core.batch import Batch
from dataflow.core.errors import DataError, DataflowError, StoreUnavailableError
from dataflow.io.array_readers import (
    RESIDENT_BYTES,
    ArrayReader,
    DaskArrayReader,
    MemoryArrayReader,
    ZarrArrayReader,
    fetch_ahead,
)
from dataflow.io.cf_stores import cf_decoded
from dataflow.io.chunk_reader import EpochChunkReader
from dataflow.io.credentials import StorageOptions
from dataflow.io.fetch import DEFAULT_FETCH_AHEAD_MB, FetchAhead, megabytes, opened_remote
from dataflow.io.metadata_check import corrupt_metadata
from dataflow.io.read_errors import missing_chunk_error
from dataflow.io.region import (
    Bounds,
    RegionView,
    array_cuts,
    common_shape,
    compose,
)
from dataflow.io.store_access import store_access_error
from dataflow.io.store_retry import DEFAULT_RETRY_S, open_with_retries, retry_seconds
from dataflow.io.xarray_adapters import (
    is_dask_array,
    is_data_array,
    is_xarray_dataset,
    may_read_zarr,
)
from dataflow.io.xarray_backing import check_complete, raw_zarr
from dataflow.io.xarray_slices import ZarrBox, ZarrSplit, stored_dims, zarr_box


class VariableNotFoundError(DataError, KeyError):
    """``x`` or ``y`` names an array that is not in the store or Dataset."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


def _label(store: Any) -> str:
    if isinstance(store, (zarr.Array, zarr.Group)):
        return str(store.store_path)
    if isinstance(store, (ZarrSplit, ZarrBox)):
        return str(store)
    if is_xarray_dataset(store):
        return f"xarray.Dataset({', '.join(map(str, store.data_vars))})"
    if is_dask_array(store):
        return f"dask.array{tuple(store.shape)}"
    if is_data_array(store):
        return f"xarray.DataArray({store.name!r}, shape {tuple(store.shape)})"
    return str(store)


def _open_zarr(
    store: str | Path, storage_options: dict[str, Any] | None, caller: str = "ZarrSource"
) -> Any:
    """The zarr group or array at a path or fsspec URL; ``caller`` names who asked (the
    tools open stores through this too: ``io.store_open``). A failure that passes is
    raised as it is, for the caller to try again (``io.store_retry.open_with_retries``)."""
    options = {} if storage_options is None else {"storage_options": storage_options}
    try:
        return zarr.open(store=str(store), mode="r", **options)
    except FileNotFoundError as exc:
        raise DataError(
            f"{caller}(store={str(store)!r}): no zarr array or group there; check the path "
            "(write one with dataflow.io.to_zarr)"
        ) from exc
    except Exception as exc:  # no credentials, refused, unreachable: say so and the fix
        refused = store_access_error(caller, store, None, exc)
        if refused is None or isinstance(refused, StoreUnavailableError):
            raise
        raise refused from exc


def _dimension_names(array: Any) -> tuple[str, ...] | None:
    if isinstance(array, zarr.Array):
        return stored_dims(array)
    return getattr(array, "dims", None)


def _sample_axis(field: str, name: str, array: Any, sample_dim: int | str, label: str) -> int:
    ndim = len(array.shape)
    if isinstance(sample_dim, str):
        dims = _dimension_names(array)
        if dims is None or sample_dim not in dims:
            coordinate = dims is not None and tuple(dims) == (name,)
            raise DataError(
                f"ZarrSource(sample_dim={sample_dim!r}): {field} ({name!r} in {label}) has "
                f"dimensions {dims}; name one of those, or give the sample axis as an int"
                + (
                    f" ({name!r} is a coordinate, the labels of dimension {name!r}: did you "
                    "mean a data variable?)"
                    if coordinate
                    else ""
                )
            )
        return dims.index(sample_dim)
    if ndim == 0 or not -ndim <= sample_dim < ndim:
        raise DataError(
            f"ZarrSource(sample_dim={sample_dim}): out of range for {field} ({name!r}, shape "
            f"{tuple(array.shape)}); use 0..{max(ndim - 1, 0)}"
        )
    return sample_dim % ndim


def _check_dtype(field: str, name: str, dtype: Any, label: str) -> None:
    dtype = np.dtype(dtype)
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
        raise DataError(
            f"ZarrSource({field}={name!r}) in {label} has dtype {dtype}, which is not numeric; "
            "rewrite it as numbers (e.g. with dataflow.io.to_zarr)"
        )


def _names(field: str, value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if not value:
            raise DataError(f"ZarrSource({field}=()): name at least one array, or pass None")
        return list(value)
    return [value]


class ZarrSource(RegionView):
    """Samples along ``sample_dim`` of arrays ``x`` (and ``y``) of a chunked store.

    ``store``: a path or fsspec URL, an opened zarr group or array, an xarray Dataset
    (one opened from zarr is read raw) or DataArray, or a dask array; a single array
    is x itself. xarray data read through xarray has the chunks of the zarr arrays
    behind it checked when the source is built (``io.xarray_backing``).
    ``x``: an array name, or a list of names for several inputs (batches then hold
    a tuple, and the model is called as ``model(*x)``). ``y``: a name, or None for
    unsupervised training. ``sample_dim``: the axis (int) or dimension name (str,
    from xarray's dimension names) that indexes samples; it is moved to axis 0.
    ``storage_options``: fsspec's, for a URL (credentials print as ``'***'``;
    ``io.credentials``); ``fetch_ahead_mb``: a remote store's chunk objects fetched
    ahead of the decode, at most (``io.fetch``).
    Pickles by its open parameters and reopens lazily on a worker (a remote store's
    arrays travel opened: no request to reopen them).
    """

    def __init__(
        self,
        store: Any,
        x: str | Sequence[str] | None = "x",
        y: str | None = None,
        *,
        sample_dim: int | str = 0,
        shuffle: bool = True,
        storage_options: dict[str, Any] | None = None,
        fetch_ahead_mb: float = DEFAULT_FETCH_AHEAD_MB,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        if isinstance(sample_dim, bool) or not isinstance(sample_dim, (int, str)):
            raise DataError(
                f"ZarrSource(sample_dim={sample_dim!r}): must be an axis (int, e.g. 0) or a "
                "dimension name (str, e.g. 'sample')"
            )
        if isinstance(y, (list, tuple)):
            raise DataError(f"ZarrSource(y={y!r}): y is one array name (or None)")
        # a zarr store's values as stored: read raw, chunk-aware, missing chunks caught
        names = [*_names("x", x), *_names("y", y)]
        # CF-packed or masked arrays of a path: read decoded, as xarray reads them
        self.store = raw_zarr(cf_decoded(store, names, storage_options, "ZarrSource"), names)
        self.x_name = x
        self.y_name = y
        self.sample_dim = sample_dim
        self.shuffle = bool(shuffle)
        # Credentials in it stay out of every repr (io.credentials); fsspec gets them whole
        self.storage_options = StorageOptions.of(storage_options)
        self.fetch_ahead_mb = megabytes(
            "ZarrSource",
            "fetch_ahead_mb",
            fetch_ahead_mb,
            "the MB of a remote store's chunks fetched ahead of the decode",
            DEFAULT_FETCH_AHEAD_MB,
        )
        self.retry_s = retry_seconds("ZarrSource", retry_s)
        self._readers: list[ArrayReader] | None = None
        self._region: Bounds | None = None  # see region()
        self._xarray_checked = False  # xarray data's stored chunks: checked on the driver
        readers = open_with_retries(self._open, self.retry_s, "ZarrSource", self.store)
        self._xarray_checked = True  # (a worker reopening it does not list them again)
        if len({r.num_samples for r in readers}) != 1:
            counts = ", ".join(f"{r.field} ({r.name!r}) has {r.num_samples}" for r in readers)
            raise DataError(
                f"ZarrSource: sample counts differ along sample_dim={sample_dim!r}: {counts}; "
                "every input and target needs the same count"
            )
        self._num_samples = readers[0].num_samples
        if self._num_samples == 0:
            raise DataError(f"ZarrSource: x ({readers[0].name!r}) has no samples along sample_dim")

    # -- opening ----------------------------------------------------------------
    def _open(self) -> list[ArrayReader]:
        """Readers for the x arrays then y (None-free), validated; a damaged metadata file
        (``zarr.json``, ``.zarray``, ...) is named, whatever zarr raised about it."""
        if self._readers is not None:
            return self._readers
        try:
            return self._open_readers()
        except Exception as exc:
            if isinstance(exc, DataflowError) and not isinstance(exc, VariableNotFoundError):
                raise
            names = self.x_name if isinstance(self.x_name, (list, tuple)) else [self.x_name]
            members = [n for n in [*names, self.y_name] if isinstance(n, str)]
            problem = corrupt_metadata(self.store, members, self.storage_options)
            if problem is None:
                raise
            raise DataError(
                f"ZarrSource(store={_label(self.store)!r}): the metadata file {problem}; "
                "re-write the store (e.g. with dataflow.io.to_zarr) or restore that file from "
                "a copy of the store"
            ) from exc

    def _open_readers(self) -> list[ArrayReader]:
        store, label = self.store, _label(self.store)
        if isinstance(store, (str, Path)):
            opened = getattr(self, "_opened", None)  # a remote store's, from the driver
            store = _open_zarr(store, self.storage_options) if opened is None else opened
        elif not isinstance(store, (zarr.Array, zarr.Group, ZarrSplit, ZarrBox)) and not (
            is_xarray_dataset(store) or is_dask_array(store) or is_data_array(store)
        ):
            raise DataError(
                f"ZarrSource(store=...): got {type(store).__name__}; pass a path, an fsspec URL "
                "such as 'file:///data/x.zarr', an opened zarr.Array / zarr.Group, an "
                "xarray.Dataset or DataArray, or a dask.array"
            )
        single = isinstance(store, (zarr.Array, ZarrBox))
        single = single or is_dask_array(store) or is_data_array(store)
        x_names = _names("x", self.x_name)
        if single:
            if self.y_name is not None or len(x_names) > 1:
                raise DataError(
                    f"ZarrSource: store {label} is a single array, which is x itself; open its "
                    "group (or pass an xarray.Dataset) to name x and y"
                )
            name = (
                str(store.name) if is_data_array(store) or isinstance(store, ZarrBox) else "<array>"
            )
            readers = [self._reader("x", name, store, label)]
        else:
            if not x_names:
                raise DataError(
                    f"ZarrSource(x=None): store {label} holds several arrays; name the input(s), "
                    f"from {self._available(store)}"
                )
            fields = ["x"] if len(x_names) == 1 else [f"x[{i}]" for i in range(len(x_names))]
            readers = [
                self._reader(field, name, self._member(store, field, name, label), label)
                for field, name in zip(fields, x_names, strict=True)
            ]
            if self.y_name is not None:
                y_array = self._member(store, "y", self.y_name, label)
                readers.append(self._reader("y", self.y_name, y_array, label))
        if self._region is not None:
            for reader in readers:
                if reader.field != "y":  # targets are never cut
                    cuts = array_cuts(self._region, reader.seen_shape, reader.seen_sample_dim)
                    reader.restrict(cuts)
        if isinstance(self.store, (str, Path)):
            self._opened = opened_remote(store, [r.array for r in readers])
        main = max((r for r in readers if r.field != "y"), key=lambda r: r.nbytes)
        for reader in readers:
            reader.resident = reader is not main and reader.nbytes <= RESIDENT_BYTES
        self._main = main
        self._readers = readers
        return readers

    @staticmethod
    def _available(store: Any) -> list[str]:
        if is_xarray_dataset(store):
            return sorted(map(str, store.variables))
        if isinstance(store, ZarrSplit):
            return sorted(store.boxes)
        return sorted(store.array_keys())

    def _member(self, store: Any, field: str, name: Any, label: str) -> Any:
        if not isinstance(name, str):
            raise DataError(f"ZarrSource({field}=...): must be an array name (str), got {name!r}")
        available = self._available(store)
        if name not in available:
            raise VariableNotFoundError(
                f"ZarrSource({field}={name!r}): no array {name!r} in {label}; "
                f"the arrays there are {available}"
            )
        if isinstance(store, ZarrSplit):
            return store.boxes[name]
        return store.variables[name] if is_xarray_dataset(store) else store[name]

    def _reader(self, field: str, name: str, array: Any, label: str) -> ArrayReader:
        _check_dtype(field, name, array.dtype, label)
        axis = _sample_axis(field, name, array, self.sample_dim, label)
        if isinstance(array, zarr.Array):
            return ZarrArrayReader(field, array, axis, self.retry_s)
        box = array if isinstance(array, ZarrBox) else None  # traced on the driver
        if box is None and may_read_zarr(array):
            box = zarr_box(array)
        if box is not None:  # a slice of a zarr array made in xarray or dask: read raw
            return ZarrArrayReader(
                field,
                box.array,
                box.kept[axis],  # (the stored axis of the variable's sample axis)
                self.retry_s,
                (box.lo, box.hi),
                box.dropped,
                box.decode,
            )
        if may_read_zarr(array) and not self._xarray_checked:  # xarray or dask
            check_complete(array, "ZarrSource", field, name)
        data = getattr(array, "data", array) if not isinstance(array, np.ndarray) else array
        if is_dask_array(data):
            return DaskArrayReader(field, name, data, axis)
        chunks = getattr(array, "encoding", {}).get("chunks")
        unit = chunks[axis] if chunks else max(1, (8 * 2**20) // max(1, _sample_bytes(array, axis)))
        return MemoryArrayReader(field, name, getattr(array, "values", data), axis, unit)

    # -- regions (spatial decomposition) -----------------------------------------
    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's x shape, sample axis removed, whole (before any region)."""
        shapes = {r.field: r.sample_shape for r in self._open() if r.field != "y"}
        return common_shape(f"ZarrSource(x={self.x_name!r})", shapes)

    def region(self, bounds: Mapping[int, tuple[int, int]]) -> ZarrSource:
        """A view reading only ``[lo, hi)`` along each given axis of every sample's x
        (whole-sample coordinates, axis 0 the channels; see ``io.region``); y is whole.
        Only the chunks intersecting the region are fetched and checked to exist."""
        new = compose("ZarrSource", bounds, self.sample_shape, self._region)
        view = copy.copy(self)
        view._readers = view._main = None  # reopened with the cut on first use
        view._region = new
        return view

    # -- the Source contract ---------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def chunk_bounds(self) -> np.ndarray:
        """Chunk offsets along the sample dim: those of the (largest) input array, the one
        whose chunks are worth decoding only once."""
        self._open()
        return self._main.bounds

    @property
    def chunk_samples(self) -> int:
        """Samples in the largest chunk (the unit the shuffle buffer counts in)."""
        return int(np.diff(self.chunk_bounds).max())

    def check_chunks(self, chunks: Sequence[int]) -> None:
        """Raise ``ChunkMissingError`` naming the first absent stored object among the
        objects that hold ``chunks`` (in :attr:`chunk_bounds` numbering), in every array."""
        bounds = self.chunk_bounds
        chunks = np.asarray(sorted(chunks), dtype=np.int64)
        if len(chunks) == 0:
            return
        starts, stops = bounds[chunks], bounds[chunks + 1]
        for reader in self._open():
            missing = reader.missing(reader.chunks_covering(starts, stops))
            if missing:
                raise missing_chunk_error(reader, missing)

    def read_chunks(self, chunks: Sequence[int]) -> dict[int, Batch]:
        """Decode ``chunks`` in one request per array: zarr fetches and decodes all of them
        concurrently. Each value is one chunk's samples (in a buffer of its own, so a chunk's
        memory is reused as soon as the chunk reader drops it)."""
        bounds = self.chunk_bounds
        ordered = sorted(int(c) for c in chunks)
        ranges = [(int(bounds[c]), int(bounds[c + 1])) for c in ordered]
        slabs = [reader.read_slabs(ranges) for reader in self._open()]  # [array][chunk]
        return {
            chunk: self._batch([torch.from_numpy(s[i]) for s in slabs], stop - start)
            for i, (chunk, (start, stop)) in enumerate(zip(ordered, ranges, strict=True))
        }

    def part_layouts(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """One sample's shape and dtype of each array read, in :meth:`batch_of`'s order."""
        return [(e.shape[1:], e.dtype) for e in (r.empty() for r in self._open())]

    def read_chunks_into(
        self, chunks: Sequence[int], blocks: dict[int, list[np.ndarray]]
    ) -> dict[int, Batch]:
        """:meth:`read_chunks`, each chunk's samples written into ``blocks[chunk]`` (one
        array per :meth:`part_layouts` entry): a batch's own rows (``io.direct_batches``)."""
        bounds, decoded = self.chunk_bounds, {}
        for chunk in (int(c) for c in chunks):
            start, stop = int(bounds[chunk]), int(bounds[chunk + 1])
            for reader, block in zip(self._open(), blocks[chunk], strict=True):
                reader.read_slab_into(start, stop, block)
            tensors = [torch.from_numpy(block) for block in blocks[chunk]]
            decoded[chunk] = self._batch(tensors, stop - start)
        return decoded

    def batch_of(self, tensors: list[torch.Tensor], size: int) -> Batch:
        """A batch of the arrays' ``tensors``, in :meth:`part_layouts`' order."""
        return self._batch(tensors, size)

    def fetch_ahead(
        self, jobs: Sequence[Sequence[int]], after: FetchAhead | None = None
    ) -> FetchAhead | None:
        """A remote store (``s3://``, ``gs://``, ``https://``): the stored objects of
        ``jobs`` (lists of chunks, in the order they will be read) fetched from now on,
        many requests in flight, at most ``fetch_ahead_mb`` MB ahead of the decode
        (``io.fetch``; ``after``: the plan of the reads before, sharing the budget); None
        for a local store. The chunk reader closes it."""
        bounds = self.chunk_bounds
        ranges = [(int(bounds[c]), int(bounds[c + 1])) for job in jobs for c in sorted(job)]
        return fetch_ahead(self._open(), ranges, self.fetch_ahead_mb, after)

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices`` (in that order) as one batch, sample dim first.

        For random access (evaluation, the dry run); training reads whole chunks
        through ``io.chunk_reader``. Missing chunks are checked here too.
        """
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(index) and (index.min() < 0 or index.max() >= self._num_samples):
            raise DataError(
                f"ZarrSource.read: indices must lie in [0, {self._num_samples}); "
                f"got {index.min()}..{index.max()}"
            )
        if len(index) == 0:
            batch = self._batch([torch.from_numpy(r.empty()) for r in self._open()], 0)
        else:  # one batch of the chunk reader: checks the chunks exist, decodes each once
            batch = next(iter(EpochChunkReader(self, [index])))
        batch.indices = indices
        return batch

    def _batch(self, tensors: list[torch.Tensor], size: int) -> Batch:
        has_y = self.y_name is not None
        xs = tensors[:-1] if has_y else tensors
        x = tuple(xs) if isinstance(self.x_name, (list, tuple)) else xs[0]
        return Batch(x=x, y=tensors[-1] if has_y else None, size=size)

    # -- pickling ----------------------------------------------------------------
    @property
    def store_retries(self) -> int:
        """Reads of this copy sent again to a store failing in a way that passes."""
        readers = self._readers or []
        return sum(r.retry.retries for r in readers if isinstance(r, ZarrArrayReader))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = state["_main"] = None  # open handles stay behind; reopened on first use
        # but a remote store's arrays travel opened (metadata only): a worker's open would
        # cost a round trip per metadata object, a second or more at 100 ms each
        return state

    def __repr__(self) -> str:
        region = "" if self._region is None else f", region={self._region}"
        return (
            f"ZarrSource({_label(self.store)!r}, x={self.x_name!r}, y={self.y_name!r}, "
            f"num_samples={self._num_samples}, shuffle={self.shuffle}{region})"
        )


def _sample_bytes(array: Any, axis: int) -> int:
    shape = list(array.shape)
    shape.pop(axis)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(array.dtype).itemsize
