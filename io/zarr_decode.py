"""Decode zarr chunks on the calling thread, so several threads decode at once.

Zarr 3's reads (``Array[...]``, ``AsyncArray.get_orthogonal_selection``) run on its
own event loop: every thread's request goes through that one loop thread, which
fetches, hands each chunk to zarr's thread pool to decode, and copies the decoded
chunks into the output itself. :class:`ChunkDecoder` does the same work with zarr's
synchronous pieces instead, all on the thread that asks: the stored bytes of each
object (``store.get_sync``; a remote store without it, e.g. fsspec's, takes what an
epoch's plan fetched ahead, ``io.fetch``, and fetches the rest of a read together on
zarr's loop), the array's codecs in reverse (``_decode_sync``:
zstd, blosc and gzip release the GIL while they decode), then one copy of the part
the read wants into the output. ``io.chunk_reader`` calls it from its pool of
``decode_threads`` threads, one chunk per call, so the decode rate grows with the
threads, and one thread decodes on one core.

Only for the layouts it knows (:func:`chunk_decoder` says None otherwise, and the
caller reads through zarr): a regular chunk grid, no sharding, and codecs that all
decode synchronously (zarr v3's), or zarr v2's numcodecs compressor and filters
(decoded as zarr's ``V2Codec`` does). An object absent from the store raises
:class:`MissingObject` (zarr would return the fill value); one that fails to decode
raises :class:`ObjectDecodeError`; both name the object. The codecs run here are the
array's own, so any checksum they carry (zstd's content checksum, ``crc32c``, v2's
``crc32`` filter, gzip's CRC) is verified on these threads as in zarr: a chunk whose
bytes changed fails its decode (``io.checksums``) instead of yielding garbage.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import zarr
from numcodecs.compat import ensure_ndarray_like
from zarr.core.buffer import default_buffer_prototype

from dataflow.io.chunk_cache import ChunkCache, Decoding
from dataflow.io.direct_decode import crc32c_decoded, direct_decoder
from dataflow.io.fetch import FetchAhead, fetch_now
from dataflow.io.store_access import store_access_error
from dataflow.io.store_retry import StoreRetry


class MissingObject(Exception):
    """A stored object a read needs is absent."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class ObjectDecodeError(Exception):
    """A stored object could not be decoded (``__cause__``: what the codec raised)."""

    def __init__(self, key: str, error: Exception) -> None:
        super().__init__(f"{key}: {error}")
        self.key = key
        self.error = error


def chunk_decoder(array: zarr.Array) -> ChunkDecoder | None:
    """A :class:`ChunkDecoder` for ``array``, or None where zarr must read it itself."""
    metadata = array.metadata
    if getattr(metadata, "zarr_format", None) not in (2, 3) or array.shards is not None:
        return None
    if type(metadata.chunk_grid).__name__ != "RegularChunkGrid":
        return None
    pipeline = array.async_array.codec_pipeline
    aa = getattr(pipeline, "array_array_codecs", None)
    ab = getattr(pipeline, "array_bytes_codec", None)
    bb = getattr(pipeline, "bytes_bytes_codecs", None)
    if aa is None or ab is None or bb is None:
        return None
    if not all(_decodes_here(codec) for codec in (*aa, ab, *bb)):
        return None
    return ChunkDecoder(array, tuple(aa), ab, tuple(bb))


def _decodes_here(codec: Any) -> bool:
    return hasattr(codec, "_decode_sync") or _is_v2(codec)


def _is_v2(codec: Any) -> bool:
    return type(codec).__name__ == "V2Codec" and hasattr(codec, "compressor")


def _decode_v2(codec: Any, stored: Any, spec: Any) -> Any:
    """What zarr's ``V2Codec`` does, on this thread (numeric dtypes: ZarrSource's)."""
    chunk = stored.as_array_like()
    if codec.compressor:
        chunk = codec.compressor.decode(chunk)
    for f in reversed(codec.filters or ()):
        chunk = f.decode(chunk)
    chunk = ensure_ndarray_like(chunk).view(spec.dtype.to_native_dtype())
    chunk = chunk.reshape(-1, order="A").reshape(spec.shape, order=spec.order)
    return spec.prototype.nd_buffer.from_ndarray_like(chunk)


class ChunkDecoder:
    """Reads a box of a zarr array from its stored objects, on the calling thread."""

    def __init__(
        self, array: zarr.Array, aa: tuple[Any, ...], ab: Any, bb: tuple[Any, ...]
    ) -> None:
        self.array = array
        self.store = array.store_path.store
        self.prefix = f"{array.path}/" if array.path else ""
        self.shape = tuple(int(s) for s in array.shape)
        self.chunks = tuple(int(c) for c in array.chunks)
        prototype = default_buffer_prototype()
        config = array.async_array.config
        if array.metadata.zarr_format == 2:  # v2 keeps the memory order in its metadata
            config = dataclasses.replace(config, order=array.metadata.order)
        spec = array.metadata.get_chunk_spec((0,) * len(self.shape), config, prototype)
        # Each codec decodes with the spec the codecs before it resolved (as zarr's
        # pipeline does: a transpose changes the shape the bytes codec sees).
        steps: list[tuple[Any, Any]] = []
        for codec in aa:
            steps.append((codec, spec))
            spec = codec.resolve_metadata(spec)
        steps.append((ab, spec))
        spec = ab.resolve_metadata(spec)
        for codec in bb:
            steps.append((codec, spec))
            spec = codec.resolve_metadata(spec)
        self._steps = steps[::-1]  # decoding runs the codecs backwards
        # a whole chunk decoded straight into the read's output where the codecs allow
        self._decode_into = direct_decoder(self._steps)
        # the values' type in this machine's order: the ``bytes`` codec's order decides
        # how the chunk is stored, whatever byte order the array's dtype names
        self._dtype = np.dtype(spec.dtype.to_native_dtype()).newbyteorder("=")
        self._prototype = prototype
        self._get_sync = getattr(self.store, "get_sync", None)
        self.plans: list[FetchAhead] = []  # epochs' objects fetched ahead (remote stores)
        self.cache: ChunkCache | None = None  # decoded chunks kept across reads (PatchSource)
        self.decoded: list[int] = []  # bytes of each object decoded (append: thread-safe)
        self.retry = StoreRetry()  # the source's retry_s (its reader sets it)

    def key(self, coords: Sequence[int]) -> str:
        return self.prefix + self.array.metadata.encode_chunk_key(tuple(coords))

    def keys(self, lo: Sequence[int], hi: Sequence[int]) -> list[str]:
        """The stored keys a read of the box ``[lo, hi)`` decodes, in the order it does."""
        ranges = [
            range(a // c, (b - 1) // c + 1) if b > a else range(0)
            for a, b, c in zip(lo, hi, self.chunks, strict=True)
        ]
        return [self.key(coords) for coords in itertools.product(*ranges)]

    def read(self, selection: Sequence[slice], out: np.ndarray) -> np.ndarray:
        """Write ``array[selection]`` (slices with no step) into ``out``; return ``out``.
        With a :attr:`cache`, a chunk kept there or being decoded by another thread is
        taken from it; each chunk decoded here is offered to it."""
        bounds = [
            (s.start or 0, self.shape[a] if s.stop is None else s.stop)
            for a, s in enumerate(selection)
        ]
        ranges = [
            range(lo // c, (hi - 1) // c + 1) if hi > lo else range(0)
            for (lo, hi), c in zip(bounds, self.chunks, strict=True)
        ]
        objects = list(itertools.product(*ranges))
        if self._decode_into is not None and self.cache is None and out.dtype == self._dtype:
            objects = self._decode_whole_chunks(objects, bounds, out)
        self.visit(objects, lambda coords, chunk: self._copy(chunk, coords, bounds, out))
        return out

    def _decode_whole_chunks(
        self, objects: list[tuple[int, ...]], bounds: Sequence[tuple[int, int]], out: np.ndarray
    ) -> list[tuple[int, ...]]:
        """Decode each object whose whole chunk fills one contiguous block of ``out``
        straight into it (``io.direct_decode``); return the others."""
        direct, rest = [], []
        for coords in objects:
            source, target = self._regions(coords, bounds)
            whole = all(
                s.start == 0 and s.stop == c for s, c in zip(source, self.chunks, strict=True)
            )
            block = out[target] if whole else None
            if block is not None and block.flags.c_contiguous:
                direct.append((self.key(coords), block))
            else:
                rest.append(coords)
        stored = self._fetch([key for key, _ in direct]) if direct else []
        for (key, block), data in zip(direct, stored, strict=True):
            self._decoded(key, data, block)
        return rest

    def visit(
        self,
        objects: Sequence[tuple[int, ...]],
        take: Callable[[tuple[int, ...], np.ndarray], None],
    ) -> None:
        """Hand each stored object's decoded chunk (at chunk coordinates ``objects``) to
        ``take`` once, one at a time, so a caller copies what it needs from each without
        holding them all: those kept in the :attr:`cache` or decoded here first, in order,
        those another thread is decoding after (never a cycle). Each chunk decoded here
        is offered to the cache."""
        keys = [self.key(coords) for coords in objects]
        cache = self.cache
        kept = [None if cache is None else cache.acquire(key) for key in keys]
        mine = [key for key, chunk in zip(keys, kept, strict=True) if chunk is None]
        try:
            if self._get_sync is None:
                for key, chunk in zip(keys, kept, strict=True):
                    if chunk is not None:
                        self._planned(key)  # fetched ahead but decoded already: let it go
            fetched = iter(self._fetch(mine))
            waiting = []
            for coords, key, chunk in zip(objects, keys, kept, strict=True):
                if isinstance(chunk, Decoding):
                    waiting.append((coords, key, chunk))  # after ours: never a cycle
                    continue
                if chunk is None:
                    chunk = self._decoded(key, next(fetched))
                    if cache is not None:
                        cache.put(key, chunk)
                        mine.remove(key)
                take(tuple(coords), chunk)
            for coords, key, decoding in waiting:
                chunk = decoding.wait()
                if chunk is None:  # that thread's decode failed: ours names the object
                    chunk = self._decoded(key, self._fetch([key])[0])
                take(tuple(coords), chunk)
        finally:
            for key in mine if cache is not None else ():  # claimed, not decoded:
                cache.abandon(key)  # the threads waiting for it decode it themselves

    def _decoded(self, key: str, stored: Any, block: np.ndarray | None = None) -> np.ndarray:
        """The object ``key`` decoded: into a new array, or straight into ``block``."""
        if stored is None:
            raise MissingObject(key)
        try:
            if block is None:
                chunk = self._decode(stored)
            else:
                self._decode_into(stored, block)
                chunk = block
        except Exception as exc:
            raise ObjectDecodeError(key, exc) from exc
        self.decoded.append(chunk.nbytes)
        return chunk

    def _copy(
        self,
        chunk: np.ndarray,
        coords: Sequence[int],
        bounds: Sequence[tuple[int, int]],
        out: np.ndarray,
    ) -> None:
        """The part of ``chunk`` (at ``coords``) inside ``bounds``, into ``out``."""
        source, target = self._regions(coords, bounds)
        out[target] = chunk[source]

    def _regions(
        self, coords: Sequence[int], bounds: Sequence[tuple[int, int]]
    ) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """The part of the chunk at ``coords`` inside ``bounds``: its slices in the chunk
        and in the read's output."""
        source, target = [], []
        for i, c, (lo, hi) in zip(coords, self.chunks, bounds, strict=True):
            start, stop = max(lo, i * c), min(hi, (i + 1) * c)
            source.append(slice(start - i * c, stop - i * c))
            target.append(slice(start - lo, stop - lo))
        return tuple(source), tuple(target)

    def _fetch(self, keys: list[str]) -> list[Any]:
        """The stored objects ``keys``, fetched again while the store fails in a way that
        passes (``io.store_retry``); a store refusing them (credentials, permission, no
        route, or failing for longer than the retries) is a StoreAccessError naming the
        object and the fix."""
        try:
            return self.retry.run(lambda: self._fetch_objects(keys))
        except Exception as exc:
            key = getattr(exc, "key", None) or (keys[0] if keys else None)
            refused = store_access_error("", self.array, key, exc)
            if refused is None:
                raise
            raise refused from exc

    def _fetch_objects(self, keys: list[str]) -> list[Any]:
        if self._get_sync is not None:  # a local or in-memory store: read here
            return [self._get_sync(key, prototype=self._prototype) for key in keys]
        # A remote store: what an epoch's plan fetched ahead (io.fetch), the rest together now
        ahead = [self._planned(key) for key in keys]
        rest = [key for key, future in zip(keys, ahead, strict=True) if future is None]
        now = iter(fetch_now(self.store, rest, self._prototype) if rest else ())
        return [next(now) if future is None else future.result() for future in ahead]

    def _planned(self, key: str) -> Future | None:
        for plan in list(self.plans):
            future = plan.take(self.store, key)
            if future is not None:
                return future
        return None

    def _decode(self, stored: Any) -> np.ndarray:
        data = stored
        for codec, spec in self._steps:
            if _is_v2(codec):
                data = _decode_v2(codec, data, spec)
            elif type(codec).__name__ == "Crc32cCodec":  # checked without the GIL if it can
                data = crc32c_decoded(codec, data, spec)
            else:
                data = codec._decode_sync(data, spec)
        return data.as_numpy_array()
