"""Which zarr arrays an xarray object (or a dask array) reads, so that data reaching
the engine through xarray or dask is checked for missing chunks as a raw zarr read is.

xarray reads a zarr-backed variable lazily, through a chain of its indexing adapters
that ends in its ``ZarrArrayWrapper`` (``open_dataset(..., chunks=None)``), or through a
dask array whose graph holds that chain (``open_zarr``'s default). A chunk absent from
the store reads there as the array's fill value, unseen: a fit would train on it.
``dask.array.from_zarr`` is the same with the zarr array itself at the graph's root.
Three answers, for three uses:

* :func:`raw_zarr`: what the sources read instead of a zarr-backed Dataset, or of a
  DataArray that is all of a zarr array unchanged (:func:`unmodified_zarr_array`): the
  store or the array, read raw, each read checked; and for a split made in xarray
  (``ds.sel(time=slice(...))``), the box of a zarr array each variable reads
  (``io.xarray_slices.zarr_box``, gathered in a ``ZarrSplit``), which both sources
  then read raw as well (``PatchSource`` moves its windows by the box's origin,
  ``io.patch_arrays``);
* :func:`check_complete`: for xarray data that is neither (scaled, computed, sliced
  with a step), every stored object of every zarr array it reads must exist (only
  those of the box it reads, where it reads one), asked once with one listing per
  array.

How xarray holds its data is in ``io.xarray_adapters``: a version of xarray that
changes it makes every answer "none found" (the data is then read as it was before,
through xarray, and checked whole), never a wrong array.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import zarr

from dataflow.core.errors import ChunkMissingError
from dataflow.io.region import chunk_range
from dataflow.io.xarray_adapters import (
    backend_data,
    from_zarr,
    is_dask_array,
    is_data_array,
    is_xarray_dataset,
    reads_as_stored,
    zarr_arrays_behind,
)
from dataflow.io.xarray_slices import ZarrBox, ZarrSplit, zarr_box


def unmodified_zarr_array(value: Any) -> zarr.Array | None:
    """The zarr array the xarray ``value`` (a DataArray or Variable) or dask array is an
    unmodified view of: all of it, in its dtype, with no CF decoding, slicing or
    arithmetic in between; else None."""
    box = zarr_box(value)
    return box.array if box is not None and box.whole else None


def group_of(boxes: list[ZarrBox], names: list[str]) -> zarr.Group | None:
    """The zarr group whose arrays ``boxes`` take whole (named ``names``), opened on the
    very store object xarray opened (a remote store with its storage options); None
    unless all of them are whole arrays of one group of one store."""
    arrays = [box.array for box in boxes if box.whole]
    if not arrays or len(arrays) != len(boxes):
        return None
    stores = {id(a.store_path.store) for a in arrays}
    parents = {a.path.rpartition("/")[0] for a in arrays}
    if len(stores) != 1 or len(parents) != 1:
        return None
    store = arrays[0].store_path.store
    try:
        group = zarr.open_group(store=store, path=parents.pop(), mode="r")
    except Exception:  # not opened as a group: read as the arrays' boxes
        return None
    return group if set(names) <= set(group.array_keys()) else None


def zarr_path_backing(dataset: Any, names: list[str], boxes: list[ZarrBox]) -> str | None:
    """The path of the zarr store an xarray Dataset was opened from, if reading it raw
    gives the same values: each variable's data (``names``) still all of that store's
    array of its name, as stored (``boxes``: each variable traced by
    :func:`~dataflow.io.xarray_slices.zarr_box`: no CF unpacking or masking, and nothing
    computed or loaded since: ``ds.assign(t=ds.t * 2)`` and ``ds.load()`` keep the
    Dataset's ``encoding["source"]``, not its values); None where the path alone does not
    open it (a remote store opened with storage options) or differs."""
    source = dataset.encoding.get("source")
    if not isinstance(source, str):
        return None
    try:
        group = zarr.open_group(source, mode="r")
    except Exception:  # not a zarr store, or not without its options
        return None
    for name, box in zip(names, boxes, strict=True):
        variable = dataset.variables.get(name)
        if variable is None or name not in group.array_keys():
            return None
        stored = group[name]
        if not box.whole or not reads_as_stored(variable, stored):
            return None
        if (box.array.path, str(box.array.store_path.store)) != (
            stored.path,
            str(stored.store_path.store),
        ):
            return None  # another store's array under this name
    return source


def raw_zarr(store: Any, names: list[str]) -> Any:
    """What the sources read instead of ``store`` where its values are a zarr store's as
    stored (each read then raw: chunk-aware, and missing chunks are caught), traced here
    once (on the driver: what this returns travels to the workers without the xarray
    objects and their dask graphs):

    * a Dataset: the path it was opened from (:func:`zarr_path_backing`), else the group
      its variables are all of (:func:`group_of`), else, where each is a box of a zarr
      array (a split made in xarray), those boxes (``ZarrSplit``);
    * a DataArray or dask array: the zarr array it is all of, or the box of one it is;
    * anything else, or any variable read otherwise (a stride, arithmetic): unchanged.
    """
    if is_xarray_dataset(store):
        variables = [store.variables.get(name) for name in names]
        if not names or any(v is None for v in variables):
            return store
        boxes = [zarr_box(v) for v in variables]  # (each traced once, here)
        if any(box is None for box in boxes):
            return store
        path = zarr_path_backing(store, names, boxes)  # type: ignore[arg-type]
        if path is not None:
            return path
        group = group_of(boxes, names)  # type: ignore[arg-type]
        return ZarrSplit(dict(zip(names, boxes, strict=True))) if group is None else group
    if is_data_array(store) or is_dask_array(store):
        box = zarr_box(store)
        if box is None:
            return store
        return box.array if box.whole else box
    return store


def _object_grid(array: zarr.Array, box: ZarrBox | None = None) -> list[range]:
    """The coordinates of ``array``'s stored objects along each axis (those holding any
    of ``box``, where given)."""
    unit = array.shards or array.chunks
    if box is not None:
        return [chunk_range(lo, hi, c) for lo, hi, c in zip(box.lo, box.hi, unit, strict=True)]
    return [range(math.ceil(s / c)) for s, c in zip(array.shape, unit, strict=True)]


def absent_objects(array: zarr.Array, box: ZarrBox | None = None) -> list[str]:
    """The keys of ``array``'s stored objects (chunks, or shards) absent from its store
    (of those holding any of ``box``, where given): one listing of the array's prefix."""
    from zarr.core.sync import sync

    grid = _object_grid(array, box)
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
    box = zarr_box(value)  # a slice reads only its box: only its chunks must exist
    arrays = [box.array] if box is not None else zarr_arrays_behind(value)
    for array in arrays:
        absent = absent_objects(array, box)
        if absent:
            total = math.prod(len(axis) for axis in _object_grid(array, box))
            which = "stored" if box is None or box.whole else "the slice reads"
            fill = array.fill_value
            fill = fill.item() if hasattr(fill, "item") else fill
            raise ChunkMissingError(
                f"{source}({field}={name!r}): {len(absent)} of the {total} chunks {which} "
                f"of zarr array {array.path or name!r} in store "
                f"{str(array.store_path.store)!r} are missing, the first {absent[0]!r}; "
                f"xarray reads a missing chunk as the fill value ({fill!r}), which would be "
                "trained on (or copied) unseen. Re-write or re-copy the store (zarr skips "
                "all-fill-value chunks unless written with write_empty_chunks=True, as "
                "dataflow.io.to_zarr does)"
            )
    if not arrays and from_zarr(value) and not is_dask_array(backend_data(value)):
        warnings.warn(
            f"{source}({field}={name!r}): this xarray data was read from a zarr store but "
            "is in memory now, so a chunk missing from the store (read as its fill value) "
            "cannot be checked; pass the Dataset opened from the store (lazily) instead",
            RuntimeWarning,
            stacklevel=3,
        )
