"""The box of a zarr array that a sliced xarray variable reads, so that a split made in
xarray (``ds.sel(time=slice("1990", "2010"))``, ``ds.isel(lat=slice(0, 64))``) is read
raw: only the chunks the box touches are fetched and checked, a missing one outside it
refuses nothing, and a remote store's chunks are fetched ahead as for a whole array.

xarray slices lazily in one of two places, each followed back to the zarr array here:

* the key of its ``LazilyIndexedArray`` (``open_dataset(..., chunks=None)``): one tuple
  of slices over the zarr array;
* a dask ``getitem`` over the blocks of the read (``open_zarr``'s default): every block
  of the sliced array is traced back, task by task (``Alias`` for a whole block,
  ``getitem`` for part of one, ``getter`` for the read of the zarr array's region: known
  from ``from_array``'s ``Blockwise`` layer without building its tasks), and the blocks
  must tile one box in order.

Only a box (slices with step 1, or an integer index: ``ds.sel(level=500)``, that axis
``dropped``; no transpose) with nothing else between it and the zarr array counts;
xarray's CF decoding on the way (unpacking, masking, `_Unsigned`) is kept as the very functions it
applies (``ZarrBox.decode``: the readers apply them to every slab read). Anything else
(a step, arithmetic, a rechunk, a dask or xarray version whose internals differ) gives
None, and the data is read through xarray and checked
whole (``io.xarray_backing``). The trace runs once, where a source is built: a source
holds the boxes it found (:class:`ZarrSplit`), not the Dataset, so it travels to the
workers without the dask graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from dataflow.io.xarray_adapters import (
    PASS_THROUGH,
    adapter_chain,
    backend_data,
    dask_roots,
    decodes_nothing,
    is_dask_array,
    zarr_of,
)

# [lo, hi) per axis of the stored array, and the axes taken at one index (dropped)
Traced = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# dask's tasks that read a block of the from_array source (dask.array.core)
_GETTERS = {"getter", "getter_nofancy", "getter_inline"}


@dataclass(frozen=True)
class ZarrBox:
    """``array[lo[0]:hi[0], lo[1]:hi[1], ...]``: what an xarray variable reads, as stored,
    with the axes ``dropped`` (taken at one index, ``ds.sel(level=500)``: ``hi = lo + 1``)
    left out of its shape; ``dims``: the variable's dimension names."""

    array: zarr.Array
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    dims: tuple[str, ...] | None = None
    dropped: tuple[int, ...] = ()
    # xarray's CF decoding of the stored values (unpacking, masking), innermost first:
    # the very functions its lazy arrays apply (:func:`decoded`); () for none
    decode: tuple[Any, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        """The variable's shape: the box's, the dropped axes left out."""
        return tuple(self.hi[a] - self.lo[a] for a in self.kept)

    @property
    def kept(self) -> list[int]:
        """The stored axes the variable has (all but the dropped ones), in order."""
        return [a for a in range(len(self.lo)) if a not in self.dropped]

    @property
    def dtype(self) -> np.dtype:
        """The variable's dtype: the stored one, decoded (``float64`` of packed ``int16``)."""
        return decoded(self.decode, np.zeros(0, self.array.dtype)).dtype

    @property
    def whole(self) -> bool:
        """All of the stored array, read as stored."""
        return not self.dropped and not self.decode and self.shape == tuple(self.array.shape)

    @property
    def name(self) -> str:
        """The array's name in its store (its path's last part)."""
        return self.array.path.rpartition("/")[2] or str(self.array.store_path)

    @property
    def cuts(self) -> str:
        """``[time 3:765, level 2]``: the axes it does not take whole (by the stored
        array's dimension names where it has them)."""
        dims = stored_dims(self.array) or tuple(f"axis {a}" for a in range(len(self.lo)))
        cuts = [
            f"{dim} {lo}" if axis in self.dropped else f"{dim} {lo}:{hi}"
            for axis, (dim, lo, hi, n) in enumerate(
                zip(dims, self.lo, self.hi, self.array.shape, strict=True)
            )
            if (lo, hi) != (0, n) or axis in self.dropped
        ]
        return f"[{', '.join(cuts)}]" if cuts else ""

    def __str__(self) -> str:
        """``file:///data/era5.zarr/t2m[time 3:765]``."""
        return f"{self.array.store_path}{self.cuts}"


def decoded(decode: tuple[Any, ...], raw: np.ndarray) -> np.ndarray:
    """``raw`` stored values as xarray decodes them (``ZarrBox.decode``, innermost first):
    the same functions on the same values, elementwise, so a slab at a time gives what
    xarray gives for the whole array, bit for bit."""
    for func in decode:
        raw = func(raw)
    return np.asarray(raw)


# xarray's CF decoders (``xarray.coding.variables``) applied through its lazy
# ``_ElementwiseFunctionArray``: unpacking (``scale_factor``, ``add_offset``) and masking
# (``_FillValue``, ``missing_value`` as NaN). Any other elementwise function (times,
# booleans) is not traced: read through xarray
_CF_DECODERS = {"_scale_offset_decoding", "_apply_mask"}


def _is_cf_decoder(func: Any) -> bool:
    """One of :data:`_CF_DECODERS`, or ``_Unsigned``'s reinterpretation of the stored
    integers (netCDF's unsigned bytes kept as signed: ``partial(np.asarray, dtype=u1)``,
    a cast of each value alone, so a slab at a time casts as the whole array does)."""
    inner = getattr(func, "func", None)
    if getattr(inner, "__name__", "") in _CF_DECODERS:
        return True
    keywords = getattr(func, "keywords", None) or {}
    return (
        inner is np.asarray
        and not getattr(func, "args", ())
        and set(keywords) == {"dtype"}
        and np.dtype(keywords["dtype"]).kind in "iu"
    )


def stored_dims(array: zarr.Array) -> tuple[str, ...] | None:
    """A zarr array's dimension names (zarr v3's, or xarray's ``_ARRAY_DIMENSIONS`` in v2)."""
    names = getattr(array.metadata, "dimension_names", None)
    if names is None:
        names = array.attrs.get("_ARRAY_DIMENSIONS")
    return None if names is None else tuple(names)


@dataclass(frozen=True)
class ZarrSplit:
    """What a split made in xarray reads (each variable a box of a zarr array), decided
    once where the source is built. A source holds it instead of the Dataset: it travels
    to the workers as the arrays and their boxes, with no dask graph to pickle and trace
    again there (a graph of a million blocks takes tens of seconds to trace), and it
    names the boxes in messages."""

    boxes: dict[str, ZarrBox]

    def __str__(self) -> str:
        """``split of 'file:///era5.zarr': t[time 0:96], tp (CF-decoded)``; ``arrays of``
        where nothing is cut (a store read decoded)."""
        stores = sorted({str(b.array.store_path.store) for b in self.boxes.values()})
        boxes = ", ".join(
            f"{box.name}{box.cuts}{' (CF-decoded)' if box.decode else ''}"
            for box in self.boxes.values()
        )
        kind = "split" if any(box.cuts for box in self.boxes.values()) else "arrays"
        return f"{kind} of {', '.join(map(repr, stores))}: {boxes}"


def zarr_box(value: Any) -> ZarrBox | None:
    """The box of a zarr array the xarray ``value`` (a DataArray or Variable) or dask
    array reads unchanged (whole, or sliced with step 1); None for anything else."""
    data = backend_data(value)
    found = _dask_box(data) if is_dask_array(data) else _lazy_box(data)
    if found is None:
        return None
    array, (lo, hi, dropped), decode = found
    box = ZarrBox(array, lo, hi, getattr(value, "dims", None), dropped, decode)
    if box.shape != tuple(value.shape) or box.dtype != value.dtype:
        return None
    if not decode and not decodes_nothing(value, array):
        return None  # (xarray decodes it some other way)
    return box


def _slices_box(key: Any, shape: tuple[int, ...]) -> Traced | None:
    """``[lo, hi)`` per axis of a key of slices with step 1 (or an index: that axis
    dropped, ``hi = lo + 1``) over an array of ``shape``."""
    key = getattr(key, "value", key)  # a dask DataNode
    if not isinstance(key, tuple) or len(key) != len(shape):
        return None
    lo, hi, dropped = [], [], []
    for axis, (k, n) in enumerate(zip(key, shape, strict=True)):
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            if not -n <= k < n:
                return None
            lo.append(int(k) % n)
            hi.append(int(k) % n + 1)
            dropped.append(axis)
            continue
        if not isinstance(k, slice):
            return None
        start, stop, step = k.indices(n)
        if step != 1 or stop <= start:
            return None
        lo.append(start)
        hi.append(stop)
    return tuple(lo), tuple(hi), tuple(dropped)


def _within(parent: Traced, key: Any) -> Traced | None:
    """``key`` (slices and indices over ``parent``'s axes that are not dropped) applied
    to the box ``parent``: the box it selects, in the stored array's coordinates."""
    lo, hi, dropped = parent
    kept = [a for a in range(len(lo)) if a not in dropped]
    part = _slices_box(key, tuple(hi[a] - lo[a] for a in kept))
    if part is None:
        return None
    new_lo, new_hi = list(lo), list(hi)
    for j, axis in enumerate(kept):
        new_lo[axis], new_hi[axis] = lo[axis] + part[0][j], lo[axis] + part[1][j]
    return tuple(new_lo), tuple(new_hi), tuple(sorted((*dropped, *(kept[j] for j in part[2]))))


def _lazy_box(root: Any) -> tuple[zarr.Array, Traced, tuple[Any, ...]] | None:
    """The zarr array at the end of ``root``'s adapters, the box their one indexing key
    selects (the whole array where none does) and xarray's CF decoding on the way
    (innermost first), when nothing else is in between."""
    box, decode = None, []
    for adapter in adapter_chain(root):
        array = zarr_of(adapter)
        if array is not None:
            whole = (0,) * array.ndim, tuple(int(s) for s in array.shape), ()
            return array, whole if box is None else box, tuple(reversed(decode))
        kind = type(adapter).__name__
        if kind == "_ElementwiseFunctionArray":
            func = getattr(adapter, "func", None)
            if not _is_cf_decoder(func):
                return None
            decode.append(func)
            continue
        if kind not in PASS_THROUGH:
            return None
        if kind == "LazilyIndexedArray":
            inner = getattr(adapter.array, "shape", None)
            key = getattr(getattr(adapter, "key", None), "tuple", None)
            if box is not None or inner is None:
                return None  # two keys in one chain: xarray composes them into one
            box = _slices_box(key, tuple(inner))
            if box is None:
                return None
    return None


def _dask_box(data: Any) -> tuple[zarr.Array, Traced, tuple[Any, ...]] | None:
    """The zarr array behind a dask array and the box its blocks tile, traced task by
    task from each block back to the read of the whole array."""
    roots = dask_roots(data)
    read = _lazy_box(roots[0]) if len(roots) == 1 else None
    if read is None or read[1] != ((0,) * read[0].ndim, tuple(read[0].shape), ()):
        return None  # the read itself must be of the whole array
    array, decode = read[0], read[2]
    layers = data.__dask_graph__().layers
    original = next(name for name in layers if str(name).startswith("original-"))
    tasks: dict[Any, Any] = {}
    reads: dict[Any, Any] = {}  # from_array's read layers, by name: their block slices
    for layer in layers.values():
        slices = _read_slices(layer, original)
        if slices is None:
            tasks.update(dict(layer))
        else:  # never built block by block (most of a trace's time, at 10^5 blocks)
            reads[layer.output] = slices
    traced: dict[Any, Traced | None] = {}
    shape = tuple(int(s) for s in array.shape)

    def box_of(key: Any, depth: int = 0) -> Traced | None:
        if key not in traced:
            if isinstance(key, tuple) and key and key[0] in reads:
                traced[key] = _read_box(reads[key[0]], key[1:], shape)
            else:
                traced[key] = _trace(tasks.get(key), original, array, box_of, depth)
        return traced[key]

    chunks = data.chunks
    first = box_of((data.name, *([0] * len(chunks))))
    if first is None:
        return None
    lo, _, dropped = first
    kept = [a for a in range(len(lo)) if a not in dropped]
    if len(kept) != len(chunks):
        return None
    offsets = [np.concatenate([[0], np.cumsum(c)]).tolist() for c in chunks]
    for index in itertools.product(*(range(len(c)) for c in chunks)):
        block_lo, block_hi = list(lo), [a + 1 for a in lo]  # (dropped axes: as the first)
        for j, axis in enumerate(kept):
            block_lo[axis] = lo[axis] + offsets[j][index[j]]
            block_hi[axis] = lo[axis] + offsets[j][index[j] + 1]
        if box_of((data.name, *index)) != (tuple(block_lo), tuple(block_hi), dropped):
            return None
    hi = [a + 1 for a in lo]
    for j, axis in enumerate(kept):
        hi[axis] = lo[axis] + int(data.shape[j])
    return array, (lo, tuple(hi), dropped), decode


def _read_slices(layer: Any, original: str) -> Any:
    """The slices of each block that a ``Blockwise`` layer made by ``from_array`` reads
    of ``original`` (its ``ArraySliceDep``), known without building its tasks: the
    layer's one task template ``getter(original, slices of the block)`` and nothing
    else; None for any other layer (its tasks are then traced one by one)."""
    if type(layer).__name__ != "Blockwise":
        return None
    task = getattr(layer, "task", None)
    deps = getattr(layer, "io_deps", None) or {}
    indices = getattr(layer, "indices", None)
    if type(task).__name__ != "Task" or getattr(task, "kwargs", None) or len(deps) != 1:
        return None
    if getattr(getattr(task, "func", None), "__name__", "") not in _GETTERS:
        return None
    args = [getattr(a, "key", None) for a in getattr(task, "args", ())]
    if args != ["__dask_blockwise__0", "__dask_blockwise__1"] or not indices or len(indices) != 2:
        return None
    (source, source_index), (dep_name, dep_index) = indices
    (dep,) = deps.values()
    if getattr(source, "key", None) != original or source_index is not None:
        return None
    if dep_name not in deps or tuple(dep_index) != tuple(layer.output_indices):
        return None
    if type(dep).__name__ != "ArraySliceDep" or layer.new_axes or layer.concatenate:
        return None
    return dep if getattr(layer, "output_blocks", None) is None else None


def _read_box(slices: Any, index: tuple, shape: tuple[int, ...]) -> Traced | None:
    """The box block ``index`` of a ``from_array`` read layer (:func:`_read_slices`) reads."""
    numblocks = getattr(slices, "numblocks", None)
    if numblocks is None or len(index) != len(numblocks):
        return None
    if not all(isinstance(i, int) and 0 <= i < n for i, n in zip(index, numblocks, strict=True)):
        return None
    return _slices_box(slices[index], shape)


def _trace(task: Any, original: str, array: zarr.Array, box_of: Any, depth: int) -> Traced | None:
    """The box of ``array`` one task computes: an alias of a block, a step-1 slice (or an
    index) of a block, or the read of a region of the whole array; None for any other."""
    if task is None or depth > 64:
        return None
    kind = type(task).__name__
    if kind == "Alias":
        target = getattr(task, "target", None)
        return box_of(getattr(target, "key", target), depth + 1)
    if kind != "Task" or getattr(task, "kwargs", None):
        return None
    name = getattr(getattr(task, "func", None), "__name__", "")
    args = getattr(task, "args", ())
    if len(args) != 2 or type(args[0]).__name__ != "TaskRef":
        return None
    source = args[0].key
    if name in _GETTERS and source == original:
        return _slices_box(args[1], tuple(int(s) for s in array.shape))
    if name == "getitem":
        parent = box_of(source, depth + 1)
        return None if parent is None else _within(parent, args[1])
    return None
