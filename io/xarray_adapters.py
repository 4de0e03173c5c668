"""How xarray and dask hold data read lazily from zarr: the type checks, the chain of
xarray's indexing adapters from a variable down to its ``ZarrArrayWrapper``, the roots
of a dask graph, and whether xarray's values are the stored ones.

The adapters are xarray's internals (``Variable._data``, ``.array``, ``.key``,
``ZarrArrayWrapper.get_array``), recognised by their class names: a version of xarray
that changes them makes every question here answer "none found" (the data is then read
through xarray, and checked whole: ``io.xarray_backing``), never a wrong array.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr

PASS_THROUGH = {
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


def backend_data(value: Any) -> Any:
    """The data behind a DataArray or Variable (its lazy adapters or dask array, never
    loaded), or ``value`` itself."""
    variable = getattr(value, "variable", value)
    return getattr(variable, "_data", value)


def adapter_chain(adapter: Any) -> Iterator[Any]:
    """``adapter`` and each array it wraps (``.array``), outermost first."""
    seen: set[int] = set()
    while adapter is not None and id(adapter) not in seen:
        seen.add(id(adapter))
        yield adapter
        adapter = getattr(adapter, "array", None)


def zarr_of(wrapper: Any) -> zarr.Array | None:
    if isinstance(wrapper, zarr.Array):  # dask.array.from_zarr's root
        return wrapper
    if type(wrapper).__name__ != "ZarrArrayWrapper":
        return None
    try:
        array = wrapper.get_array()
    except Exception:  # another xarray version's wrapper
        return None
    return array if isinstance(array, zarr.Array) else None


def dask_roots(data: Any) -> list[Any]:
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
    data = backend_data(value)
    roots = dask_roots(data) if is_dask_array(data) else [data]
    found: dict[int, zarr.Array] = {}
    for root in roots:
        for adapter in adapter_chain(root):
            array = zarr_of(adapter)
            if array is not None:
                found.setdefault(id(array), array)
    return list(found.values())


def decodes_nothing(value: Any, array: zarr.Array) -> bool:
    """Whether xarray reads ``array`` into ``value`` (a DataArray or Variable) unchanged:
    the same dtype, no CF unpacking (``scale_factor``, ``add_offset``) and no CF
    masking, which xarray applies and a raw read would not (a ``_FillValue`` or
    ``missing_value`` of -999 or 1e20 read as NaN; a float fill value of NaN already
    is NaN)."""
    if array.dtype != value.dtype:
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


def reads_as_stored(value: Any, array: zarr.Array) -> bool:
    """Whether xarray's values of ``value`` are all of ``array`` as stored: the same
    shape, and :func:`decodes_nothing`."""
    return tuple(array.shape) == tuple(value.shape) and decodes_nothing(value, array)


def from_zarr(value: Any) -> bool:
    """Whether the xarray ``value``'s encoding says it was read from a zarr store."""
    encoding = getattr(value, "encoding", None) or {}
    return bool(_ZARR_ENCODING & set(encoding))
