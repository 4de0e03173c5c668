"""Which zarr arrays an xarray object (or a dask array) reads, so that data reaching
the engine through xarray or dask is checked for missing chunks as a raw zarr read is.

xarray reads a zarr-backed variable lazily, through a chain of its indexing adapters
that ends in its ``ZarrArrayWrapper`` (``open_dataset(..., chunks=None)``), or through a
dask array whose graph holds that chain (``open_zarr``'s default). A chunk absent from
the store reads there as the array's fill value, unseen: a fit would train on it.
``dask.array.from_zarr`` is the same with the zarr array itself at the graph's root.
Two answers, for two uses:

* :func:`unmodified_zarr_array`: the zarr array a ``DataArray`` is an unmodified view
  of (the whole array, no CF decoding, no arithmetic), which the sources then read raw,
  each read checked, as they read a zarr-backed ``Dataset``;
* :func:`check_complete`: for xarray data that is not such a view (sliced, scaled,
  computed), every stored object of every zarr array it reads must exist, asked once
  with one listing per array.

The adapters are xarray's internals (``Variable._data``, ``.array``, ``.key``,
``ZarrArrayWrapper.get_array``), recognised by their class names: a version of xarray
that changes them makes both answers "none found" (the data is then read as it was
before, through xarray), never a wrong array.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr

from dataflow.core.errors import ChunkMissingError

# The adapters a lazily opened variable's data passes through unchanged: caching,
# copy-on-write, indexing (identity keys only), the implicit-to-explicit bridge dask uses.
_PASS_THROUGH = {
    "MemoryCachedArray",
    "CopyOnWriteArray",
    "LazilyIndexedArray",
    "ImplicitToExplicitIndexingAdapter",
}
# Keys of a variable's encoding that only xarray's zarr backend writes
_ZARR_ENCODING = {"compressors", "compressor", "serializer", "shards"}


def is_xarray_dataset(value: Any) -> bool:
    return type(value).__name__ == "Dataset" and hasattr(value, "data_vars")


def is_dask_array(value: Any) -> bool:
    return type(value).__module__.startswith("dask.array") and hasattr(value, "chunks")


def is_xarray_data(value: Any) -> bool:
    """Whether ``value`` is an xarray DataArray or Variable."""
    return type(value).__module__.startswith("xarray.") and hasattr(value, "encoding")


def may_read_zarr(value: Any) -> bool:
    """Whether ``value`` is xarray data or a dask array: it may read zarr arrays lazily."""
    return is_xarray_data(value) or is_dask_array(value)


def is_data_array(value: Any) -> bool:
    return type(value).__name__ == "DataArray" and hasattr(value, "dims")


def _backend_data(value: Any) -> Any:
    """The data behind a DataArray or Variable (its lazy adapters or dask array, never
    loaded), or ``value`` itself."""
    variable = getattr(value, "variable", value)
    return getattr(variable, "_data", value)


def _chain(adapter: Any) -> Iterator[Any]:
    """``adapter`` and each array it wraps (``.array``), outermost first."""
    seen: set[int] = set()
    while adapter is not None and id(adapter) not in seen:
        seen.add(id(adapter))
        yield adapter
        adapter = getattr(adapter, "array", None)


def _zarr_of(wrapper: Any) -> zarr.Array | None:
    if isinstance(wrapper, zarr.Array):  # dask.array.from_zarr's root
        return wrapper
    if type(wrapper).__name__ != "ZarrArrayWrapper":
        return None
    try:
        array = wrapper.get_array()
    except Exception:  # another xarray version's wrapper
        return None
    return array if isinstance(array, zarr.Array) else None


def _dask_roots(data: Any) -> list[Any]:
    """The adapters a dask array's graph starts from (``from_array``'s ``original-``
    layers: xarray's default, ``inline_array=False``)."""
    graph = data.__dask_graph__()
    layers = getattr(graph, "layers", {})
    roots = []
    for name, layer in layers.items():
        if str(name).startswith("original-"):
            roots += [getattr(value, "value", value) for value in dict(layer).values()]
    return roots


def zarr_arrays_behind(value: Any) -> list[zarr.Array]:
    """Every zarr array ``value`` (a DataArray, a Variable or a dask array) reads from,
    however it was sliced or computed since; none for data in memory."""
    data = _backend_data(value)
    roots = _dask_roots(data) if is_dask_array(data) else [data]
    found: dict[int, zarr.Array] = {}
    for root in roots:
        for adapter in _chain(root):
            array = _zarr_of(adapter)
            if array is not None:
                found.setdefault(id(array), array)
    return list(found.values())


def _identity_key(adapter: Any, shape: tuple[int, ...]) -> bool:
    """Whether a ``LazilyIndexedArray``'s key selects the whole array, in order."""
    key = getattr(getattr(adapter, "key", None), "tuple", None)
    if key is None or len(key) != len(shape):
        return False
    for k, n in zip(key, shape, strict=True):
        if not isinstance(k, slice) or k.indices(n) != (0, n, 1):
            return False
    return True


def _unmodified_chain(root: Any) -> zarr.Array | None:
    """The zarr array at the end of ``root``'s chain, when every adapter on the way
    passes the data through unchanged."""
    for adapter in _chain(root):
        array = _zarr_of(adapter)
        if array is not None:
            return array
        kind = type(adapter).__name__
        if kind not in _PASS_THROUGH:
            return None
        if kind == "LazilyIndexedArray" and not _identity_key(adapter, adapter.array.shape):
            return None
    return None


def unmodified_zarr_array(value: Any) -> zarr.Array | None:
    """The zarr array the xarray ``value`` (a DataArray or Variable) is an unmodified
    view of: all of it, in its dtype, with no CF decoding or arithmetic in between (a
    dask array straight from ``open_zarr``: its graph is the read alone); else None."""
    data = _backend_data(value)
    if is_dask_array(data):
        name = getattr(data, "name", None)
        layers = set(getattr(data.__dask_graph__(), "layers", {}))
        if layers != {name, f"original-{name}"}:
            return None
        roots = _dask_roots(data)
        array = _unmodified_chain(roots[0]) if len(roots) == 1 else None
    else:
        array = _unmodified_chain(data)
    return array if array is not None and reads_as_stored(value, array) else None


def reads_as_stored(value: Any, array: zarr.Array) -> bool:
    """Whether xarray's values of ``value`` (a DataArray or Variable) are ``array``'s
    as stored: the same shape and dtype, no CF unpacking (``scale_factor``,
    ``add_offset``) and no CF masking, which xarray applies and a raw read would not (a
    ``_FillValue`` or ``missing_value`` of -999 or 1e20 read as NaN; a float fill value
    of NaN already is NaN)."""
    if tuple(array.shape) != tuple(value.shape) or array.dtype != value.dtype:
        return False
    encoding = getattr(value, "encoding", {}) or {}
    if {"scale_factor", "add_offset"} & set(encoding):
        return False
    floating = np.issubdtype(array.dtype, np.floating)
    for key in ("_FillValue", "missing_value"):
        fills = np.atleast_1d(encoding.get(key, [])).tolist()
        if not all(f is None or (floating and f != f) for f in fills):  # (f != f: NaN)
            return False
    return True


def group_behind(dataset: Any, names: list[str]) -> zarr.Group | None:
    """The zarr group whose arrays the Dataset's variables ``names`` are unmodified
    views of (:func:`unmodified_zarr_array`), opened on the very store object xarray
    opened (a remote store with its storage options); None unless all of them are, in
    one group of one store."""
    variables = [dataset.variables.get(name) for name in names]
    arrays = [None if v is None else unmodified_zarr_array(v) for v in variables]
    if not arrays or any(a is None for a in arrays):
        return None
    stores = {id(a.store_path.store) for a in arrays}
    parents = {a.path.rpartition("/")[0] for a in arrays}
    if len(stores) != 1 or len(parents) != 1:
        return None
    store = arrays[0].store_path.store
    try:
        group = zarr.open_group(store=store, path=parents.pop(), mode="r")
    except Exception:  # not opened as a group: read through xarray
        return None
    return group if set(names) <= set(group.array_keys()) else None


def zarr_backing(dataset: Any, names: list[str]) -> str | zarr.Group | None:
    """The zarr store an xarray Dataset was opened from, if reading it raw gives the same
    values (:func:`reads_as_stored`: no CF unpacking or masking, which
    xarray would apply and raw zarr would not): its path, or, where the path alone does
    not open it (a remote store opened with storage options), the group its variables'
    arrays belong to, on the store object xarray opened."""
    source = dataset.encoding.get("source")
    if isinstance(source, str):
        try:
            group = zarr.open_group(source, mode="r")
        except Exception:  # not a zarr store, or not without its options: see below
            group = None
        if group is not None:
            for name in names:
                variable = dataset.variables.get(name)
                if variable is None or name not in group.array_keys():
                    return None
                if not reads_as_stored(variable, group[name]):
                    return None
            return source
    return group_behind(dataset, names)


def raw_zarr(store: Any, names: list[str]) -> Any:
    """What the sources read instead of ``store`` where its values are a zarr store's as
    stored (each read then raw: chunk-aware, and missing chunks are caught): a
    zarr-backed Dataset as its store (:func:`zarr_backing`), a DataArray or dask array
    that is an unmodified view of a zarr array as that array; anything else unchanged."""
    if is_xarray_dataset(store):
        backing = zarr_backing(store, names)
        return store if backing is None else backing
    if is_data_array(store) or is_dask_array(store):
        return unmodified_zarr_array(store) or store
    return store


def from_zarr(value: Any) -> bool:
    """Whether the xarray ``value``'s encoding says it was read from a zarr store."""
    encoding = getattr(value, "encoding", None) or {}
    return bool(_ZARR_ENCODING & set(encoding))


def _object_grid(array: zarr.Array) -> list[range]:
    """The coordinates of ``array``'s stored objects along each axis."""
    unit = array.shards or array.chunks
    return [range(math.ceil(s / c)) for s, c in zip(array.shape, unit, strict=True)]


def absent_objects(array: zarr.Array) -> list[str]:
    """The keys of ``array``'s stored objects (chunks, or shards) absent from its store:
    one listing of the array's prefix."""
    from zarr.core.sync import sync

    grid = _object_grid(array)
    prefix = f"{array.path}/" if array.path else ""
    store = array.store_path.store

    async def listed() -> set[str]:
        return {key async for key in store.list_prefix(prefix)}

    present = sync(listed())
    expected = (prefix + array.metadata.encode_chunk_key(c) for c in itertools.product(*grid))
    return [key for key in expected if key not in present]


def check_complete(value: Any, source: str, field: str, name: str) -> None:
    """Raise ``ChunkMissingError`` naming the first stored object absent from a zarr
    array that the xarray ``value`` (``field``, variable ``name``) reads; warn when it
    was read from zarr but is in memory now, where nothing can be checked."""
    arrays = zarr_arrays_behind(value)
    for array in arrays:
        absent = absent_objects(array)
        if absent:
            total = math.prod(len(axis) for axis in _object_grid(array))
            fill = array.fill_value
            fill = fill.item() if hasattr(fill, "item") else fill
            raise ChunkMissingError(
                f"{source}({field}={name!r}): {len(absent)} of the {total} stored chunks "
                f"of zarr array {array.path or name!r} in store "
                f"{str(array.store_path.store)!r} are missing, the first {absent[0]!r}; "
                f"xarray reads a missing chunk as the fill value ({fill!r}), which would be "
                "trained on (or copied) unseen (the whole array is checked, not only what "
                "a slice of it reads). Re-write or re-copy the store (zarr skips "
                "all-fill-value chunks unless written with write_empty_chunks=True, as "
                "dataflow.io.to_zarr does)"
            )
    if not arrays and from_zarr(value) and not is_dask_array(_backend_data(value)):
        warnings.warn(
            f"{source}({field}={name!r}): this xarray data was read from a zarr store but "
            "is in memory now, so a chunk missing from the store (read as its fill value) "
            "cannot be checked; pass the Dataset opened from the store (lazily) instead",
            RuntimeWarning,
            stacklevel=3,
        )
