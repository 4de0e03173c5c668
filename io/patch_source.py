"""A source whose samples are windows of a large N-D array (a volume, a time x lat x lon
grid), read from the store as it is: no second, sample-major copy.

Samples are the windows in C order of their corners (``io.windows``). The engine reads
them in units (its chunks, given as ``chunk_members``; ``io.patch_arrays``): a zarr array
decoded here (zarr's chunks decoded on the chunk reader's decode threads, missing and
corrupt chunks named) has each window of a unit copied once, straight from the decoded
storage chunks it overlaps into its slot of the unit's x (or y), each chunk taken once
for the unit (x and y of one array alike) and no bounding box built; any other array
(numpy, dask, a sharded store) has each unit's bounding box read once and its windows
cut from it in one numpy gather (``io.windows.cut_windows``).
``shuffle=True``: units are blocks of storage chunks, so the engine's two-level shuffle
puts blocks in a random order and permutes windows within groups of ``buffer_chunks``
blocks (``Load(buffer_chunks=)``/``stream_batches``: more mixes more windows from more
blocks per batch, and holds that many blocks in memory);
each storage chunk is fetched at most ``2 ** d`` times per replica and epoch (a window
reaches into the next blocks) when the patch is no longer than a block.
``shuffle=False``: units are consecutive C-order runs, so the epoch is C order.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dataflow.core.batch import Batch
from dataflow.core.errors import ConfigError, DataError
from dataflow.io.cf_stores import cf_decoded
from dataflow.io.chunk_cache import DEFAULT_CHUNK_CACHE_MB, CachePlan, ChunkCache
from dataflow.io.chunk_index import MEMBER_INDEX
from dataflow.io.chunk_reader import EpochChunkReader
from dataflow.io.credentials import StorageOptions
from dataflow.io.fetch import DEFAULT_FETCH_AHEAD_MB, FetchAhead, megabytes, opened_remote
from dataflow.io.patch_arrays import (
    PatchArray,
    Window,
    enclosing,
    is_single_array,
    open_member,
    open_single,
    open_store,
    read_windows,
    stored_arrays,
)
from dataflow.io.patch_geometry import Geometry, resolve_geometry
from dataflow.io.patch_nan import NAN_MODES, masked_nan, refuse_nan
from dataflow.io.region import Bounds, RegionView, compose
from dataflow.io.store_retry import DEFAULT_RETRY_S, open_with_retries, retry_seconds
from dataflow.io.windows import (
    DEFAULT_BLOCK_WINDOWS,
    block_factor,
    block_groups,
    block_units,
    run_units,
)
from dataflow.io.xarray_backing import raw_zarr
from dataflow.io.xarray_slices import ZarrBox, ZarrSplit


class PatchSource(RegionView):
    """Windows of the arrays ``x`` (and ``y``) of a store, as samples.

    ``x``: an array name, or a list of names of arrays of one shape, stacked as
    channels (None: the store is itself one array). A sample's x is
    ``(V, *the array's dims in order)`` with the patch dims cut to their length
    (``V`` the number of x arrays); ``channels``: dims (names or axes) folded into
    that leading axis, in the array's order after ``V`` (``channels=("time",)`` on
    ``(time, lat, lon)`` windows gives ``(V * time, lat, lon)`` for a 2-D CNN).

    ``y``: an array of x's rank, as long as x along the patch dims, cut at the same
    window (segmentation); a sample's y is ``(*its dims)`` with the patch dims cut
    (no channel axis). ``y_shift={dim: k}``: y's corner is x's corner + ``k`` along
    ``dim`` (forecasting: x = times ``t..t+L-1``, ``y_shift={"time": L - 1 + h}``,
    ``y_patch={"time": 1}`` gives the time ``t + L - 1 + h``); ``y_patch={dim: n}``:
    y's length along ``dim`` (else the patch's). Windows whose y would leave the
    array are not samples. ``y=None``: ``Batch.y`` is None.

    ``patch={dim name or axis: length}`` (other dims are taken whole); ``stride``
    likewise (default: the patch, no overlap). Which windows: corners ``0, stride,
    2 * stride, ...`` with the window inside the array, or ``windows``, an explicit
    ``(n, d)`` int array of corners over the patch dims in the array's axis order;
    then kept where ``mask`` (a boolean array, or an array name in the store, over
    the patch dims, as long as x along them) is True on at least ``mask_fraction``
    of the window's cells (1.0: all of them).

    ``shuffle``, ``block`` (a block holds at least this many grid windows; None:
    8): see the module docstring. Pickles by its parameters and the corners; the
    store is reopened on a worker (a remote store's arrays travel opened: metadata only).

    ``storage_options``: fsspec's, for a URL (credentials print as ``'***'``,
    ``io.credentials``; without them s3fs reads the environment). ``fetch_ahead_mb``: a
    remote store's chunk objects fetched ahead of the decode, per replica (``io.fetch``),
    and ``retry_s``, how long a read retries a store failing in a way that passes
    (``io.store_retry``), as ``ZarrSource`` does. ``chunk_cache_mb``: the most decoded
    storage chunks kept per replica for the next units that reach into them
    (``io.chunk_cache``: planned from the epoch's order, each kept until its last use only,
    the one needed furthest ahead evicted first; shuffled epochs keep neighbouring blocks
    together so little is held; arrays that fit whole are kept across epochs; 0: none).

    ``nan``: a window of x holding NaN (data, or the fill value of a region never written)
    is refused with a ``DataError`` naming the array, the window and its corner
    (``"refuse"``, the default: one ``isnan`` per unit read), or read with NaN as 0 and one
    channel appended to x, 1 where every channel is valid (``"mask"``). A y holding NaN is
    always refused.
    """

    def __init__(
        self,
        store: Any,
        x: str | Sequence[str] | None = None,
        y: str | None = None,
        *,
        patch: Mapping[str | int, int],
        stride: Mapping[str | int, int] | None = None,
        windows: Any = None,
        mask: Any = None,
        mask_fraction: float = 1.0,
        y_shift: Mapping[str | int, int] | None = None,
        y_patch: Mapping[str | int, int] | None = None,
        channels: Sequence[str | int] = (),
        shuffle: bool = True,
        block: int | None = None,
        storage_options: dict[str, Any] | None = None,
        fetch_ahead_mb: float = DEFAULT_FETCH_AHEAD_MB,
        nan: str = "refuse",
        chunk_cache_mb: float = DEFAULT_CHUNK_CACHE_MB,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        if nan not in NAN_MODES:
            raise ConfigError(
                f"PatchSource(nan={nan!r}): 'refuse' (a window holding NaN raises DataError, "
                "the default) or 'mask' (NaN read as 0, a channel appended to x: 1 where valid)"
            )
        self.nan = nan
        if block is not None and (isinstance(block, bool) or not isinstance(block, int)):
            raise ConfigError(f"PatchSource(block={block!r}): an int >= 1 (windows), or None")
        if block is not None and block < 1:
            raise ConfigError(f"PatchSource(block={block}): an int >= 1 (windows), or None")
        if isinstance(y, (list, tuple)):
            raise ConfigError(f"PatchSource(y={y!r}): y is one array name (or None)")
        names = [n for n in ([*x] if isinstance(x, (list, tuple)) else [x]) if isinstance(n, str)]
        extra = [n for n in (y, mask) if isinstance(n, str)]
        # CF-packed or masked arrays of a path: read decoded, as xarray reads them
        decoded = cf_decoded(store, [*names, *extra], storage_options, "PatchSource")
        self.store = raw_zarr(decoded, [*names, *extra])
        self.x_name = x
        self.y_name = y
        self.shuffle = bool(shuffle)
        self.block = block
        # Credentials in it stay out of every repr (io.credentials); fsspec gets them whole
        self.storage_options = StorageOptions.of(storage_options)
        self.fetch_ahead_mb = megabytes(
            "PatchSource",
            "fetch_ahead_mb",
            fetch_ahead_mb,
            "the MB of a remote store's chunks fetched ahead of the decode",
            DEFAULT_FETCH_AHEAD_MB,
        )
        self.chunk_cache_mb = megabytes(
            "PatchSource",
            "chunk_cache_mb",
            chunk_cache_mb,
            "the MB of decoded storage chunks kept for the next units that reach into "
            "them, per replica",
            DEFAULT_CHUNK_CACHE_MB,
            zero="keep none",
        )
        self.retry_s = retry_seconds("PatchSource", retry_s)
        self._arrays: list[PatchArray] | None = None
        self._remote: Any = None  # a remote store's arrays, opened on the driver
        self._xarray_checked = False  # xarray data's stored chunks: checked on the driver
        arrays = open_with_retries(self._open, self.retry_s, "PatchSource", self.store)
        self._xarray_checked = True  # (a worker reopening it does not list them again)
        mask_array = mask
        if isinstance(mask, str):
            mask_array = self._member("mask", mask).read_all()
        self.geometry: Geometry = resolve_geometry(
            x=[a for a in arrays if a.field != "y"],
            y=next((a for a in arrays if a.field == "y"), None),
            patch=patch,
            stride=stride,
            windows=windows,
            mask=mask_array,
            mask_fraction=mask_fraction,
            y_shift=y_shift,
            y_patch=y_patch,
            channels=channels,
        )
        self.corners = self.geometry.corners
        self._plan = self._unit_plan(arrays[0])
        self._region: Bounds | None = None  # see region()

    # -- opening ------------------------------------------------------------------
    def _open(self) -> list[PatchArray]:
        """The x arrays then y, opened (reopened lazily after pickling)."""
        if self._arrays is not None:
            return self._arrays
        if self._remote is not None:  # opened on the driver: no round trip per metadata file
            opened, label = self._remote, str(self.store)
        else:
            opened, label = open_store(self.store, self.storage_options)
        self._opened, self._label = opened, label
        x_names = self.x_name if isinstance(self.x_name, (list, tuple)) else [self.x_name]
        if is_single_array(opened):
            if self.y_name is not None or len(x_names) > 1 or x_names[0] is not None:
                raise ConfigError(
                    f"PatchSource: store {label} is a single array, which is x itself; pass "
                    "x=None, or open its group (or an xarray.Dataset) to name x and y"
                )
            arrays = [open_single(opened, label, not self._xarray_checked)]
        else:
            if not x_names or x_names[0] is None:
                raise ConfigError(
                    f"PatchSource(x=None): store {label} holds several arrays; name the input(s)"
                )
            fields = ["x"] if len(x_names) == 1 else [f"x[{i}]" for i in range(len(x_names))]
            arrays = [self._member(f, n) for f, n in zip(fields, x_names, strict=True)]
            if self.y_name is not None:
                arrays.append(self._member("y", self.y_name))
        if isinstance(self.store, (str, Path)):
            self._remote = opened_remote(opened, [a.array for a in arrays])
        cache = ChunkCache(int(self.chunk_cache_mb * 2**20)) if self.chunk_cache_mb else None
        for array in arrays:  # one cache for all: y cut from x's array finds x's chunks
            if array.reader is not None:
                array.reader.retry.retry_s = self.retry_s  # its decoder's too
                if array.reader.decoder is not None:
                    array.reader.decoder.cache = cache
        self._arrays = arrays
        return arrays

    def _member(self, field: str, name: Any) -> PatchArray:
        return open_member(self._opened, field, name, self._label, not self._xarray_checked)

    def _unit_plan(self, first: PatchArray) -> tuple[str, tuple[int, ...], int]:
        """How windows group into units: ``("block", block shape, 0)`` or ``("run", x's
        patch extent, bytes per cell of the patch dims)``."""
        g = self.geometry
        if self.shuffle:
            chunks = first.unit or first.shape  # no storage chunks: the whole array
            unit = [int(chunks[a]) for a in g.axes]
            target = self.block or DEFAULT_BLOCK_WINDOWS
            factor = block_factor(unit, g.stride, g.extents, target)
            return ("block", tuple(u * factor for u in unit), 0)
        return ("run", tuple(g.patch), g.cell_bytes)

    @property
    def _stored_origin(self) -> list[int]:
        """Where the patch dims' cell 0 is in the stored array x reads (a split of it)."""
        return [self._open()[0].origin[a] for a in self.geometry.axes]

    @functools.cached_property
    def chunk_members(self) -> list[np.ndarray]:
        """The windows (sample indices, sorted) each read unit holds."""
        kind, shape, cell_bytes = self._plan
        if kind == "block":
            return block_units(self.corners, shape, self._stored_origin)
        return run_units(self.corners, shape, cell_bytes)

    @functools.cached_property
    def chunk_groups(self) -> list[int] | None:
        """Shuffled: each unit's super-block of ``2 ** d`` neighbouring blocks, kept
        together in the epoch's order (``io.sharding``) so the chunks they share are
        decoded once (``chunk_cache_mb``); None unshuffled (C order already is)."""
        kind, shape, _ = self._plan
        if kind != "block":
            return None
        return block_groups(self.corners, self.chunk_members, shape, origin=self._stored_origin)

    # -- the Source contract ------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return len(self.corners)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's x shape (channels first; ``nan="mask"``: one more, the mask)."""
        channels, *rest = self.geometry.sample_shape
        return (channels + (self.nan == "mask"), *rest)

    @property
    def y_shape(self) -> tuple[int, ...] | None:
        """One sample's y shape (None without y)."""
        return self.geometry.y_shape

    def _corner_dims(self, index: int) -> dict[Any, int]:
        return dict(zip(self.geometry.patch_by_name, self.corner(index), strict=True))

    def corner(self, index: int) -> tuple[int, ...]:
        """Sample ``index``'s corner over the patch dims (the array's axis order)."""
        return tuple(int(c) for c in self.corners[index])

    # -- regions (spatial decomposition) -----------------------------------------
    def region(self, bounds: Mapping[int, tuple[int, int]]) -> PatchSource:
        """A view reading only ``[lo, hi)`` along each given axis of every window's x
        (whole-sample coordinates, axis 0 the channels; see ``io.region``); y is whole.
        A spatial rank's units read only its part of each window's box, so it decodes
        (and checks the existence of) only the storage chunks that part touches."""
        view = copy.copy(self)
        view._region = compose("PatchSource", bounds, self.sample_shape, self._region)
        return view

    def _windows(self, members: np.ndarray) -> list[Window]:
        """Per array (x then y), the low corner over all its axes of each window of
        ``members`` and the window's shape (x's narrowed to the region)."""
        g = self.geometry
        corners = self.corners[members]
        offset, x_extent, narrowed = g.x_window(self._region)
        windows = []
        for array in self._open():
            is_y = array.field == "y"
            axes = list(g.y_axes if is_y else g.axes)
            los = np.zeros((len(corners), len(array.shape)), dtype=np.int64)
            los[:, axes] = corners + (g.y_shift if is_y else offset)
            shape = list(array.shape)
            for axis, n in zip(axes, g.y_extent if is_y else x_extent, strict=True):
                shape[axis] = int(n)
            for axis, (lo, hi) in () if is_y else narrowed.items():
                los[:, axis], shape[axis] = lo, hi - lo
            windows.append((los, tuple(shape)))
        return windows

    def _boxes(self, members: np.ndarray) -> list[tuple[list[int], list[int]]]:
        """Per array (x then y), the box ``(lo, hi)`` over all its axes that holds the
        windows ``members`` (what a read without the chunk decoder reads)."""
        return [enclosing([window]) for window in self._windows(members)]

    def _objects(self, units: Sequence[int]) -> list[list[tuple[PatchArray, list[tuple]]]]:
        """Per unit of ``units``, per stored array, the stored objects its read decodes,
        in the order ``_read_unit`` reads them (``PatchArray.objects``)."""
        arrays, members = self._open(), self.chunk_members
        groups = stored_arrays(arrays)
        per_unit = []
        for unit in units:
            windows = self._windows(members[int(unit)])
            per_unit.append(
                [(arrays[g[0]], arrays[g[0]].objects([windows[k] for k in g])) for g in groups]
            )
        return per_unit

    def check_chunks(self, chunks: Sequence[int]) -> None:
        """Raise ``ChunkMissingError`` naming the first absent stored object among those
        the units ``chunks`` read, in every array."""
        wanted: dict[str, tuple[PatchArray, set[tuple]]] = {}
        for unit in self._objects(chunks):
            for array, objects in unit:
                wanted.setdefault(array.name, (array, set()))[1].update(objects)
        for array, objects in wanted.values():
            array.missing(sorted(objects))

    def read_chunks(self, chunks: Sequence[int]) -> dict[int, Batch]:
        """Each unit: its windows read (each stored array once) and stacked."""
        return {int(c): self._read_unit(self.chunk_members[int(c)]) for c in chunks}

    def _read_unit(self, members: np.ndarray) -> Batch:
        """A zarr array decoded here: each window copied once, straight from the decoded
        storage chunks into its slot of the unit's x (or y); others: each stored array's
        bounding box read once and the windows cut from it (``patch_arrays.read_windows``)."""
        g = self.geometry
        arrays = self._open()
        windows = self._windows(members)
        xs = [k for k, a in enumerate(arrays) if a.field != "y"]
        outs: list[np.ndarray | None] = [None] * len(arrays)
        x = None
        first = [windows[k] for k, a in enumerate(arrays) if a.name == arrays[0].name]
        if len(xs) > 1 or arrays[0].cuts_from_chunks(first):  # x's channels filled in place
            dtype = np.result_type(*(arrays[k].dtype.newbyteorder("=") for k in xs))
            x = np.empty((len(members), len(xs), *windows[0][1]), dtype)
            for k in xs:
                outs[k] = x[:, k]
        cuts = read_windows(arrays, windows, outs)
        if self.nan == "refuse":
            for k in xs:
                refuse_nan(arrays[k], cuts[k], members, self._corner_dims)
        x = cuts[0][:, None] if x is None else x
        x = g.fold(x)
        if self.nan == "mask":
            x = masked_nan(x)
        if self._region is not None and self._region[0] != (0, self.sample_shape[0]):
            lo, hi = self._region[0]  # channels: cut once they are assembled (and masked)
            x = np.ascontiguousarray(x[:, lo:hi])
        y = None
        if self.y_name is not None:
            y = cuts[-1]
            refuse_nan(arrays[-1], y, members, self._corner_dims)  # never masked
            y = torch.from_numpy(y)
        return Batch(x=torch.from_numpy(x), y=y, size=len(members))

    def fetch_ahead(
        self, jobs: Sequence[Sequence[int]], after: FetchAhead | None = None
    ) -> FetchAhead | None:
        """A remote store (``s3://``, ``gs://``, ``https://``): the stored objects that the
        units ``jobs`` (lists of units, in the order they will be read) decode, fetched
        from now on, many requests in flight, at most ``fetch_ahead_mb`` MB ahead of the
        decode (``io.fetch``; ``after``: the plan of the reads before, sharing the
        budget); None for a local store. The chunk reader closes it."""
        arrays = [a for a in self._open() if a.fetches_ahead]
        if not arrays:
            return None
        units = [int(c) for job in jobs for c in job]
        entries = [  # in read order, as _read_unit reads them
            entry
            for unit in self._objects(units)
            for array, objects in unit
            for entry in array.fetch_plan(objects)
        ]
        if not entries:
            return None
        decoders = [a.reader.decoder for a in arrays if a.reader is not None]
        budget = int(self.fetch_ahead_mb * 2**20)
        return FetchAhead(entries, max_bytes=budget, consumers=decoders, after=after)

    def plan_reads(self, jobs: Sequence[Sequence[int]]) -> CachePlan | None:
        """The decoded-chunk cache's plan of an epoch (``io.chunk_cache``): the stored keys
        each unit of ``jobs`` decodes, in read order, so it keeps a chunk only until its
        last use and evicts the one needed furthest ahead; None without a cache, or when
        the arrays fit in it whole (then kept across epochs: decoded once per fit). The
        chunk reader closes it."""
        decoders = [a.reader.decoder for a in self._open() if a.reader is not None]
        cache = next((d.cache for d in decoders if d is not None and d.cache is not None), None)
        whole = {a.name: a.decoded_bytes for a in self._open()}  # (the stored chunks')
        if cache is None or sum(whole.values()) <= cache.max_bytes:
            return None
        units = [int(c) for job in jobs for c in job]
        keys = {  # as _read_unit reads them
            unit: [
                array.reader.decoder.key(coords)
                for array, objects in reads
                if array.cuts_direct
                for coords in objects
            ]
            for unit, reads in zip(units, self._objects(units), strict=True)
        }
        return cache.plan(jobs, keys)

    def read(self, indices: np.ndarray) -> Batch:
        """The windows at ``indices`` (in that order), through the chunk reader: the
        units they are in are checked to exist and read once."""
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.num_samples
        if len(index) and (index.min() < 0 or index.max() >= n):
            raise DataError(
                f"PatchSource.read: indices must lie in [0, {n}); got {index.min()}..{index.max()}"
            )
        if len(index) == 0:
            arrays = self._open()
            x = torch.empty((0, *self.region_shape), dtype=_torch_dtype(arrays[0].dtype))
            y = None
            if self.y_name is not None:
                y = torch.empty((0, *self.geometry.y_shape), dtype=_torch_dtype(arrays[-1].dtype))
            batch = Batch(x=x, y=y, size=0)
        else:
            batch = next(iter(EpochChunkReader(self, [index], decode_threads=1)))
        batch.indices = indices
        return batch

    # -- pickling and display -------------------------------------------------------
    @property
    def store_retries(self) -> int:
        """Reads of this copy sent again to a store failing in a way that passes."""
        return sum(a.reader.retry.retries for a in self._arrays or [] if a.reader is not None)

    def __getstate__(self) -> dict[str, Any]:
        state = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_opened", "chunk_members", "chunk_groups", MEMBER_INDEX)
        }
        state["_arrays"] = None  # open handles stay behind; reopened on first use
        return state

    def __repr__(self) -> str:
        g = self.geometry
        store = self.store
        if not isinstance(store, (str, ZarrSplit, ZarrBox)):
            store = type(store).__name__
        region = "" if self._region is None else f", region={self._region}"
        return (
            f"PatchSource({str(store)!r}, x={self.x_name!r}, y={self.y_name!r}, "
            f"patch={g.patch_by_name}, stride={g.stride_by_name}, windows={self.num_samples}, "
            f"sample_shape={self.sample_shape}, shuffle={self.shuffle}{region})"
        )


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
