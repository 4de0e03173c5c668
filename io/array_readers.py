"""Read one array of a source by chunk along its sample dimension.

Three kinds, one interface (``bounds``, ``missing``, ``read_slabs``); reads by
sample index go through ``io.chunk_reader`` so each chunk is decoded once:

- :class:`ZarrArrayReader`: a ``zarr.Array``. Zarr returns the fill value for a
  chunk absent from the store, so ``missing`` asks the store whether each stored
  object exists, and a chunk that fails to decode is named (``ChunkReadError``).
  Slabs are decoded on the calling thread (``io.zarr_decode``), so the chunk
  reader's ``decode_threads`` threads decode that many chunks at once; layouts it
  does not know (zarr v2, sharding) go through zarr's own read, several slabs in
  one request (zarr fetches and decodes all their chunks concurrently).
- :class:`DaskArrayReader`: a ``dask.array`` (e.g. an xarray variable opened with
  dask chunks). Computed chunk by chunk with the synchronous scheduler: it runs
  inside a Dask worker, where a nested distributed compute would deadlock.
- :class:`MemoryArrayReader`: a numpy array (or anything ``numpy.asarray`` takes).

A reader may be ``restrict``-ed to a region of every sample (``io.region``): every
read then selects only that region, so zarr fetches only the chunks it intersects,
and ``missing`` checks exactly those chunks.

Small arrays beside the inputs (labels, parameters: at most ``RESIDENT_BYTES``)
are made ``resident`` by the source: read whole on first use and kept, because
their chunks rarely line up with those of the inputs, and re-decoding a label
chunk for every input chunk would waste the read.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import zarr
from zarr.core.buffer.cpu import NDBuffer
from zarr.core.sync import sync

from dataflow.core.errors import ChunkReadError
from dataflow.io.batch_buffers import BatchBuffers
from dataflow.io.fetch import DEFAULT_FETCH_AHEAD_MB, FetchAhead, is_remote
from dataflow.io.read_errors import chunk_read_error, missing_chunk_error
from dataflow.io.region import chunk_range
from dataflow.io.store_access import store_access_error
from dataflow.io.store_retry import DEFAULT_RETRY_S, StoreRetry
from dataflow.io.xarray_slices import decoded
from dataflow.io.zarr_decode import MissingObject, ObjectDecodeError, chunk_decoder

RESIDENT_BYTES = 64 * 2**20
SLAB_KEEP = 32


def regular_bounds(num_samples: int, unit: int) -> np.ndarray:
    """Chunk offsets along the sample dim for chunks of ``unit`` samples (last may be short)."""
    return np.append(np.arange(0, num_samples, unit, dtype=np.int64), num_samples)


def native(block: np.ndarray) -> np.ndarray:
    """Native byte order (zarr v2 may store big-endian; torch needs native)."""
    if not block.dtype.isnative:
        block = block.astype(block.dtype.newbyteorder("="))
    return block


class ArrayReader:
    """Common part: sample dim, names, residency of small arrays, reads by index.
    ``box``: ``[lo, hi)`` per axis of ``array``, read as an array of its own (a slice of
    it made in xarray, ``io.xarray_slices``); None: all of it. ``dropped``: axes of the
    box taken at one index (``ds.sel(level=500)``): read as stored, then left out of
    every sample the reads return (a view); the source names axes without them
    (:attr:`seen_shape`, :meth:`restrict`). ``decode``: xarray's CF decoding of the
    stored values (``io.xarray_slices.decoded``), applied to every slab read."""

    def __init__(
        self,
        field: str,
        name: str,
        array: Any,
        sample_dim: int,
        box: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        dropped: tuple[int, ...] = (),
        decode: tuple[Any, ...] = (),
    ) -> None:
        self.field = field  # "x", "y", "x[1]": how the user named it in ZarrSource(...)
        self.name = name
        self.array = array
        self.sample_dim = sample_dim
        lo, hi = box if box is not None else ((0,) * len(array.shape), array.shape)
        # Where this reader's array starts in the stored one, per axis
        self.origin = tuple(int(a) for a in lo)
        self.shape = tuple(int(b) - a for a, b in zip(self.origin, hi, strict=True))
        self.dtype = np.dtype(array.dtype)
        self.num_samples = self.shape[sample_dim]
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.cuts: dict[int, tuple[int, int]] = {}  # array axis -> [lo, hi): see restrict
        self.dropped = tuple(dropped)
        self.decode = tuple(decode)
        # what reads return: the stored dtype, decoded (packed int16 read as float)
        self.out_dtype = decoded(
            self.decode, np.empty(0, native(np.empty(0, self.dtype)).dtype)
        ).dtype
        self._kept = [a for a in range(len(self.shape)) if a not in self.dropped]
        others = [a for a in range(len(self.shape)) if a != sample_dim]
        # where the dropped axes are in a slab (samples first, then the other axes)
        self._slab_dropped = tuple(1 + others.index(a) for a in self.dropped)
        self.resident = False  # set by the source for small arrays beside the inputs
        self._resident: np.ndarray | None = None
        self._lock = threading.Lock()

    @property
    def bounds(self) -> np.ndarray:
        raise NotImplementedError

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape in storage order, sample axis removed, whole (before cuts)."""
        return tuple(
            n for a, n in enumerate(self.shape) if a != self.sample_dim and a not in self.dropped
        )

    @property
    def seen_shape(self) -> tuple[int, ...]:
        """The array's shape as the source sees it (the dropped axes left out)."""
        return tuple(self.shape[a] for a in self._kept)

    @property
    def seen_sample_dim(self) -> int:
        """The sample axis among :attr:`seen_shape`'s."""
        return self._kept.index(self.sample_dim)

    def _seen(self, slab: np.ndarray) -> np.ndarray:
        """A slab (samples first) with the dropped axes left out (a view), decoded."""
        slab = np.squeeze(slab, axis=self._slab_dropped) if self.dropped else slab
        return decoded(self.decode, slab) if self.decode else slab

    def _stored_rows(self, out: np.ndarray) -> np.ndarray:
        """An output slab as the source sees it, viewed with the dropped axes put back."""
        return np.expand_dims(out, self._slab_dropped) if self.dropped else out

    @property
    def read_shape(self) -> tuple[int, ...]:
        """The array's shape as reads return it (storage order): the cut axes cut."""
        return tuple(
            hi - lo for lo, hi in (self.cuts.get(a, (0, n)) for a, n in enumerate(self.shape))
        )

    def restrict(self, cuts: dict[int, tuple[int, int]]) -> None:
        """Read only ``[lo, hi)`` along each array axis of ``cuts`` (the axes of
        :attr:`seen_shape`), before the first read."""
        self.cuts = {self._kept[a]: cut for a, cut in cuts.items()}
        self.nbytes = math.prod(self.read_shape) * self.dtype.itemsize

    def _stored(self, axis: int) -> tuple[int, int]:
        """``[lo, hi)`` read along ``axis`` in the stored array's coordinates: the cut, or
        the whole axis, moved to where the reader's array starts."""
        lo, hi = self.cuts.get(axis, (0, self.shape[axis]))
        return lo + self.origin[axis], hi + self.origin[axis]

    def _selection(self, start: int, stop: int) -> tuple[slice, ...]:
        """Samples ``[start, stop)`` and, on the cut axes, only the cut (in the stored
        array's coordinates)."""
        region = [slice(*self._stored(a)) for a in range(len(self.shape))]
        at = self.origin[self.sample_dim]
        region[self.sample_dim] = slice(start + at, stop + at)
        return tuple(region)

    def missing(self, chunks: Sequence[int]) -> list[str]:
        """Names of stored objects absent among ``chunks`` (by this array's bounds)."""
        return []

    def chunks_covering(self, starts: np.ndarray, stops: np.ndarray) -> list[int]:
        """This array's chunks that hold any sample of the ranges ``[starts[i], stops[i])``."""
        bounds = self.bounds
        first = np.searchsorted(bounds, starts, side="right") - 1
        last = np.searchsorted(bounds, np.asarray(stops) - 1, side="right") - 1
        covered: set[int] = set()
        for a, b in zip(first.tolist(), last.tolist(), strict=True):
            covered.update(range(a, b + 1))
        return sorted(covered)

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Samples ``[start, stop)`` in storage layout (sample dim where it is)."""
        raise NotImplementedError

    def read_slab(self, start: int, stop: int) -> np.ndarray:
        """Samples ``[start, stop)``, sample dim first, native byte order."""
        if self.resident:
            with self._lock:  # decode threads may ask at once: read it only once
                if self._resident is None:
                    whole = self._read(0, self.num_samples)
                    self._resident = native(np.moveaxis(whole, self.sample_dim, 0))
            return self._seen(self._resident[start:stop])
        return self._seen(native(np.moveaxis(self._read(start, stop), self.sample_dim, 0)))

    def read_slabs(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """:meth:`read_slab` of every ``(start, stop)`` of ``ranges`` (here one by one)."""
        return [self.read_slab(start, stop) for start, stop in ranges]

    def read_slab_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """:meth:`read_slab` written into ``out`` (``(stop - start, *sample shape)``, the
        dtype of :meth:`empty`); here a copy, without one where a reader can."""
        out[...] = self.read_slab(start, stop)

    def empty(self) -> np.ndarray:
        """No samples, with this array's sample shape as read and (native) dtype."""
        shape = [
            n
            for a, n in enumerate(self.read_shape)
            if a != self.sample_dim and a not in self.dropped
        ]
        return np.empty((0, *shape), dtype=self.out_dtype)


class ZarrArrayReader(ArrayReader):
    """A zarr array, or a ``box`` of one (see :class:`ArrayReader`); the storage unit is
    the shard when the array is sharded."""

    def __init__(
        self,
        field: str,
        array: zarr.Array,
        sample_dim: int,
        retry_s: float = DEFAULT_RETRY_S,
        box: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        dropped: tuple[int, ...] = (),
        decode: tuple[Any, ...] = (),
    ) -> None:
        super().__init__(field, array.path or "<array>", array, sample_dim, box, dropped, decode)
        # Reads retried while the store fails in a way that passes (io.store_retry)
        self.retry = StoreRetry(retry_s)
        self.unit = (array.shards or array.chunks)[sample_dim]
        # Decoded chunks, reused once the chunk reader has dropped them. The pool grows only
        # while that many are in use at once, so it keeps at most the peak of live chunks
        # (shuffle buffer, batch, read ahead), and never more than SLAB_KEEP, idle between
        # epochs.
        self.slabs = BatchBuffers(keep=SLAB_KEEP)
        self.decoder = chunk_decoder(array)  # None: zarr reads it (v2, sharded)
        if self.decoder is not None:
            self.decoder.retry = self.retry

    @functools.cached_property
    def bounds(self) -> np.ndarray:
        """The stored chunks' edges along the sample dim, from where the reader's array
        starts (a box's first and last chunks may be partial)."""
        at, n = self.origin[self.sample_dim], self.num_samples
        inner = np.arange((at // self.unit + 1) * self.unit, at + n, self.unit) - at
        return np.concatenate([[0], inner, [n]]).astype(np.int64)

    def _chunk_of(self, sample: int) -> int:
        """The chunk (in :attr:`bounds` numbering) holding ``sample``."""
        at = self.origin[self.sample_dim]
        return (sample + at) // self.unit - at // self.unit

    def _key(self, coords: tuple[int, ...]) -> str:
        key = self.array.metadata.encode_chunk_key(coords)
        return f"{self.array.path}/{key}" if self.array.path else key

    def _grid(self, chunks: Sequence[int]) -> list[tuple[int, ...]]:
        """Coordinates of the stored objects a read of ``chunks`` (along the sample dim)
        touches: across the other axes, all of them, or on a cut axis those it intersects."""
        unit = self.array.shards or self.array.chunks
        grid: list[Any] = [chunk_range(*self._stored(a), c) for a, c in enumerate(unit)]
        first = self.origin[self.sample_dim] // self.unit  # the stored chunk of bounds' 0
        coords = []
        for chunk in chunks:
            grid[self.sample_dim] = [first + chunk]
            coords.extend(itertools.product(*grid))
        return coords

    def missing(self, chunks: Sequence[int]) -> list[str]:
        """One concurrent ``store.exists`` per stored object, not a listing of the whole
        array (``nchunks_initialized`` lists every key, slow on object stores). Not asked:
        the objects a live fetch plan GETs (its 404 is the check, ``io.fetch``), and a
        resident array already read (its values are in memory)."""
        if self.resident and self._resident is not None:
            return []
        store = self.array.store_path.store
        plans = [] if self.decoder is None else list(self.decoder.plans)
        keys = [
            key
            for key in (self._key(coords) for coords in self._grid(chunks))
            if not any(plan.covers(store, key) for plan in plans)
        ]
        if not keys:
            return []

        async def exists_all() -> list[bool]:
            return await asyncio.gather(*(store.exists(key) for key in keys))

        found = self.retry.run(lambda: sync(exists_all()))
        return [key for key, ok in zip(keys, found, strict=True) if not ok]

    @property
    def fetches_ahead(self) -> bool:
        """Whether this array's reads take objects fetched ahead (``io.fetch``): decoded
        here (not resident, a layout ``io.zarr_decode`` knows) from a remote store."""
        return not self.resident and self.decoder is not None and is_remote(self.decoder.store)

    def fetch_plan(
        self, ranges: Sequence[tuple[int, int]], whole: bool = False
    ) -> list[tuple[Any, str, int]]:
        """``(store, key, decoded bytes)`` of each stored object that reads of ``ranges``
        (in that order) decode here, for ``io.fetch``: none where nothing is fetched
        ahead (a resident array, a layout zarr reads itself, a store read synchronously);
        ``whole``: the resident array's one read of itself."""
        remote = self.decoder is not None and is_remote(self.decoder.store)
        if not (self.fetches_ahead or (whole and remote)):
            return []
        nbytes = math.prod(self.array.chunks) * self.dtype.itemsize
        store, entries = self.decoder.store, []
        for start, stop in ranges:
            chunks = self.chunks_covering(np.array([start]), np.array([stop]))
            entries.extend((store, self._key(coords), nbytes) for coords in self._grid(chunks))
        return entries

    def _read(self, start: int, stop: int) -> np.ndarray:
        if self.decoder is not None and is_remote(self.decoder.store):
            # a resident array's whole read: every object in one round trip (zarr's own
            # read asks each object's size first, a second one)
            shape = list(self.read_shape)
            shape[self.sample_dim] = stop - start
            return self._decode_into(start, stop, np.empty(shape, self.dtype.newbyteorder("=")))
        try:
            return self.retry.run(lambda: self.array[self._selection(start, stop)])
        except Exception as exc:
            self._raise_read_error(start, stop, exc)
            raise  # unreachable: _raise_read_error always raises

    def read_slabs(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Every slab of ``ranges``, each decoded into a reused buffer (:attr:`slabs`) when
        the layout allows. On the calling thread where :attr:`decoder` knows the layout;
        else all ``ranges`` in one zarr request, which fetches and decodes every chunk they
        hold concurrently (its event loop and thread pool)."""
        if self.resident:
            return super().read_slabs(ranges)
        if self.decoder is not None:
            return [self._seen(self._decode(start, stop)) for start, stop in ranges]
        array = self.array.async_array
        outs = [self._out(stop - start) for start, stop in ranges]

        async def read_all() -> list[Any]:
            return await asyncio.gather(
                *(
                    array.get_orthogonal_selection(self._selection(start, stop), out=out)
                    for (start, stop), out in zip(ranges, outs, strict=True)
                )
            )

        try:
            blocks = self.retry.run(lambda: sync(read_all()))
        except Exception as exc:  # name the object that fails, range by range
            self._raise_if_refused(self._first_key(ranges[0][0]), exc)
            for start, stop in ranges:
                self._read(start, stop)
            raise ChunkReadError(
                f"ZarrSource: reading array {self.name!r} failed ({exc}); every chunk read "
                "alone succeeded, so the store may be changing underneath: retry, or re-copy it"
            ) from exc
        return [self._seen(native(np.moveaxis(np.asarray(b), self.sample_dim, 0))) for b in blocks]

    def _decode(self, start: int, stop: int) -> np.ndarray:
        """Samples ``[start, stop)``, decoded on this thread (see ``io.zarr_decode``)."""
        dtype = self.dtype.newbyteorder("=")  # the copy out of each chunk converts
        if self.sample_dim == 0:
            block = self.slabs.take_array(stop - start, self.read_shape[1:], dtype)
        else:  # storage layout, the sample axis moved first below
            shape = list(self.read_shape)
            shape[self.sample_dim] = stop - start
            block = np.empty(shape, dtype)
        return native(np.moveaxis(self._decode_into(start, stop, block), self.sample_dim, 0))

    def read_slab_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Decoded on this thread straight into ``out`` where the layout allows (samples
        first, a known layout): whole chunks with no copy at all (``io.direct_decode``)."""
        if self.resident or self.decoder is None or self.sample_dim != 0:
            super().read_slab_into(start, stop, out)
        elif self.decode:  # CF-decoded: decoded here into a slab of its own, then unpacked
            out[...] = self.read_slabs([(start, stop)])[0]
        else:
            self._decode_into(start, stop, self._stored_rows(out))

    def _decode_into(self, start: int, stop: int, block: np.ndarray) -> np.ndarray:
        """Samples ``[start, stop)`` decoded into ``block`` (storage layout), objects named."""
        try:
            return self.decoder.read(self._selection(start, stop), block)
        except MissingObject as exc:  # the store changed since the epoch's check
            raise missing_chunk_error(self, [exc.key]) from None
        except ObjectDecodeError as exc:
            raise self._decode_error(exc.key, exc.error) from exc.error

    def _out(self, rows: int) -> NDBuffer | None:
        """A reused buffer for a slab of ``rows`` samples: memory a previous slab left,
        already mapped (fresh memory costs a page fault per 4 KiB). Only when zarr's output
        is the slab as is: samples first, native byte order, C order."""
        if self.sample_dim != 0 or not self.dtype.isnative or self.array.order != "C":
            return None
        shape = self.read_shape[1:]
        return NDBuffer.from_numpy_array(self.slabs.take_array(rows, shape, self.dtype))

    def _first_key(self, start: int) -> str:
        """The first stored object a read from sample ``start`` takes."""
        return self._key(self._grid([self._chunk_of(start)])[0])

    def _raise_if_refused(self, key: str, exc: Exception, who: str = "ZarrSource") -> None:
        """A store that refused a read of zarr's (or failed for longer than the retries)
        is named at once, by the read's object ``key``, not re-read object by object
        (each read would wait as long)."""
        refused = store_access_error(who, self.array, key, exc)
        if refused is not None:
            raise refused from exc

    def _raise_read_error(self, start: int, stop: int, exc: Exception) -> None:
        """Re-read object by object to name the one that fails to decode."""
        self._raise_if_refused(self._first_key(start), exc)
        unit = self.array.shards or self.array.chunks
        first, last = self._chunk_of(start), self._chunk_of(stop - 1)
        for coords in self._grid(range(first, last + 1)):
            region = tuple(  # the chunk, within the cut (or box) where there is one
                slice(max(i * u, lo), min((i + 1) * u, hi))
                for i, u, (lo, hi) in zip(
                    coords, unit, (self._stored(a) for a in range(len(unit))), strict=True
                )
            )
            try:
                self.array[region]
            except Exception as chunk_exc:
                raise self._decode_error(self._key(coords), chunk_exc) from chunk_exc
        raise ChunkReadError(
            f"ZarrSource: reading array {self.name!r} failed ({exc}); every chunk read alone "
            "succeeded, so the store may be changing underneath: retry, or re-copy it"
        ) from exc

    def _decode_error(self, key: str, exc: Exception) -> ChunkReadError:
        return chunk_read_error(self.array, self.name, key, exc)


class DaskArrayReader(ArrayReader):
    """A dask array, computed one block row along the sample dim at a time."""

    @functools.cached_property
    def bounds(self) -> np.ndarray:
        sizes = self.array.chunks[self.sample_dim]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _read(self, start: int, stop: int) -> np.ndarray:
        selection = self.array[self._selection(start, stop)]  # computes only the blocks it needs
        return np.asarray(selection.compute(scheduler="synchronous"))


class MemoryArrayReader(ArrayReader):
    """An in-memory array: chunks are only a reading granularity here."""

    def __init__(self, field: str, name: str, array: Any, sample_dim: int, unit: int) -> None:
        super().__init__(field, name, array, sample_dim)
        self.unit = max(1, int(unit))

    @functools.cached_property
    def bounds(self) -> np.ndarray:
        return regular_bounds(self.num_samples, self.unit)

    def _read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.array[self._selection(start, stop)])


def fetch_ahead(
    readers: Sequence[ArrayReader],
    ranges: Sequence[tuple[int, int]],
    fetch_ahead_mb: float = DEFAULT_FETCH_AHEAD_MB,
    after: FetchAhead | None = None,
) -> FetchAhead | None:
    """The stored objects that reads of the sample ``ranges`` (in read order) decode from
    ``readers``, fetched ahead with ``fetch_ahead_mb`` MB at most fetched and not yet
    decoded (``io.fetch``); None when no reader's store is remote. Close it when done."""
    zarr_readers = [r for r in readers if isinstance(r, ZarrArrayReader)]
    # A resident array not read yet (labels) is read whole with the first chunk: first
    resident = [r for r in zarr_readers if r.resident and r._resident is None]
    entries = [entry for r in resident for entry in r.fetch_plan([(0, r.num_samples)], True)]
    entries += [
        entry
        for start, stop in ranges
        for reader in zarr_readers
        for entry in reader.fetch_plan([(start, stop)])
    ]
    if not entries:
        return None
    decoders = [r.decoder for r in zarr_readers if r.fetches_ahead or r in resident]
    budget = int(fetch_ahead_mb * 2**20)
    return FetchAhead(entries, max_bytes=budget, consumers=decoders, after=after)
