"""Fetch a remote store's objects ahead of their decode, many requests in flight.

An object store answers each request after a round trip (tens to hundreds of ms),
whatever its size; read one chunk at a time, a replica waits that long for every
chunk. But an epoch's reads are known before it starts (``io.sharding``), so the
objects it will decode, in order, are too: :class:`FetchAhead` issues their GETs on
zarr's event loop (the one the store's async client is bound to), up to
``max_requests`` at once, and keeps the bytes until the decode takes them. Memory is
bounded: an object is fetched only while the objects fetched and not yet taken,
counted at their decoded size (an upper bound of what is stored), fit in
``max_bytes``; the decode taking one makes room for the next. Latency then hides
behind the decode and the step, as long as ``max_bytes`` covers a round trip's worth
of chunks.

Used where the store has no synchronous read (zarr's ``LocalStore`` and
``MemoryStore`` have ``get_sync``, and are read on the decode threads as before):
``ZarrSource.fetch_ahead`` plans an epoch's objects and ``io.zarr_decode`` takes them
(:meth:`FetchAhead.take`); an object the plan did not hold, or not yet asked for, is
fetched when it is needed (:func:`fetch_now`), so a decode never waits on the plan's
budget. Any source that knows its reads in advance can do the same: list
``(store, key, nbytes)`` in read order, then ``take`` each key before fetching it.

Across an epoch's end: the next epoch's plan may start while this one's last objects
are still being decoded (``FetchAhead(..., after=this)``, see ``io.chunk_reader``), so
its first GETs are not on the critical path. The two share one budget: the successor
counts what its predecessor still holds, and fetches only within what is left.

One request per object: :func:`get_object` asks s3fs for the whole object at once
(s3fs's own ``cat`` first asks for the size, a second round trip per chunk). The GET
is also the existence check: an object a live plan fetches (:meth:`FetchAhead.covers`)
is not asked about with a HEAD (``ZarrArrayReader.missing``); its 404 is listed in
:attr:`FetchAhead.missing`, and the chunk reader stops the epoch at the next batch
(``io.chunk_reader``), naming the object, as a decode taking it would: no step
trains on a fill value, and an epoch start waits on one round trip, not two.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from dataflow.core.errors import ConfigError

DEFAULT_FETCH_AHEAD_MB = 256.0  # bytes fetched ahead of the decode, per source and replica
DEFAULT_REQUESTS = 32  # requests in flight at most (s3fs itself allows 10 connections)


def megabytes(
    where: str, field: str, value: Any, meaning: str, default: float, zero: str | None = None
) -> float:
    """``value`` (a source's budget in MB) as a float, or a ConfigError naming the field,
    what it is for and its default; ``zero``: what 0 means, or None when 0 is refused."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if number and (value > 0 or (value == 0 and zero is not None)):
        return float(value)
    allowed = "> 0" if zero is None else f">= 0 (0: {zero};"
    opening = " (" if zero is None else " "
    raise ConfigError(
        f"{where}({field}={value!r}): {meaning}; use a number {allowed}{opening}default "
        f"{default:g})"
    )


def is_remote(store: Any) -> bool:
    """Whether reading ``store`` costs a round trip (no synchronous read: fsspec, obstore)."""
    return getattr(store, "get_sync", None) is None


def _loop() -> asyncio.AbstractEventLoop:
    """zarr's event loop: the store's async client (aiohttp's session) is bound to it."""
    from zarr.core.sync import _get_loop

    return _get_loop()


async def get_object(store: Any, key: str, prototype: Any = None) -> Any:
    """The bytes of ``key`` in ``store`` (a zarr Buffer), or None if absent: one request."""
    prototype = prototype or default_buffer_prototype()
    fs = getattr(store, "fs", None)
    if fs is not None and hasattr(fs, "max_concurrency") and hasattr(store, "allowed_exceptions"):
        # s3fs: max_concurrency=1 skips the HEAD it sends to split large objects
        if not store._is_open:
            await store._open()
        root = store.path.rstrip("/")
        path = (f"{root}/{key}" if root else key).rstrip("/")  # as FsspecStore.get names it
        try:
            data = await fs._cat_file(path, max_concurrency=1)
        except store.allowed_exceptions:
            return None
        return prototype.buffer.from_bytes(data)
    return await store.get(key, prototype)


def fetch_now(store: Any, keys: Sequence[str], prototype: Any = None) -> list[Any]:
    """The objects ``keys`` of a remote ``store``, fetched together (one round trip)."""

    async def fetch_all() -> list[Any]:
        return await asyncio.gather(*(get_object(store, k, prototype) for k in keys))

    return sync(fetch_all())


class FetchAhead:
    """The objects ``entries`` (``(store, key, nbytes)``, in the order they will be read)
    fetched in that order, ``max_requests`` at once, the ones fetched and not taken
    within ``max_bytes`` (at least one at a time). ``take`` hands an object's fetch over;
    ``consumers`` (objects with a ``plans`` list, e.g. ``io.zarr_decode.ChunkDecoder``)
    hold this plan until :meth:`close`.

    ``fetched``: objects fetched; ``peak_in_flight``: the most requests at once;
    ``peak_bytes``: the most bytes held or in flight at once (the memory bound);
    ``missing``: the keys found absent so far."""

    def __init__(
        self,
        entries: Sequence[tuple[Any, str, int]],
        *,
        max_bytes: int,
        max_requests: int = DEFAULT_REQUESTS,
        consumers: Sequence[Any] = (),
        after: FetchAhead | None = None,
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"FetchAhead(max_requests={max_requests}): must be >= 1")
        self.entries = list(entries)
        self.max_bytes = int(max_bytes)
        self.max_requests = int(max_requests)
        self.fetched = 0
        self.peak_in_flight = 0
        self.peak_bytes = 0
        self._futures = [concurrent.futures.Future() for _ in self.entries]
        self._state = ["planned"] * len(self.entries)  # -> launched/taken, -> released
        self._taken = [False] * len(self.entries)
        self._by_key: dict[tuple[int, str], list[int]] = {}
        for i, (store, key, _) in enumerate(self.entries):
            self._by_key.setdefault((id(store), key), []).append(i)
        self._planned_keys = frozenset(self._by_key)
        self.missing: list[str] = []  # keys whose GET found no object (404), as they come
        self._held = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._loop = _loop()
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._consumers = list(consumers)  # each has a ``plans`` list it takes from
        # The plan whose reads come before this one's: what it holds counts against
        # this one's budget, and its releases wake this one (see :attr:`launched_all`)
        self._after = after
        self._successor: FetchAhead | None = None
        if after is not None:
            after._successor = self
        self.launched_all = not self.entries  # every entry launched (or skipped)
        for consumer in self._consumers:
            consumer.plans.append(self)
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self._loop)

    # -- the consumer's side (any thread) -------------------------------------------------
    def covers(self, store: Any, key: str) -> bool:
        """Whether this plan GETs ``key``: its answer is then the existence check (a 404
        is :attr:`missing`, and the decode taking it raises), so no HEAD need ask."""
        return (id(store), key) in self._planned_keys and not self._closed

    def take(self, store: Any, key: str) -> concurrent.futures.Future | None:
        """The fetch of the next planned read of ``key``, or None (not planned, or not
        started yet: then the plan skips it and the caller fetches it itself)."""
        with self._lock:
            queue = self._by_key.get((id(store), key))
            if not queue:
                return None
            i = queue.pop(0)
            self._taken[i] = True
            if self._state[i] == "planned":
                self._state[i] = "skipped"
                return None
        self._futures[i].add_done_callback(lambda _: self._release(i))
        return self._futures[i]

    def _release(self, i: int) -> None:
        """Entry ``i`` is taken and done: its bytes leave the budget, the next may start."""
        with self._lock:
            if self._state[i] != "launched":
                return
            self._state[i] = "released"
            self._held -= self.entries[i][2]
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop stopped at exit
                self._loop.call_soon_threadsafe(self._wake.set)
        successor = self._successor
        if successor is not None:  # this plan's bytes count against its successor's
            successor._poke()

    def _held_before(self) -> int:
        """The bytes the preceding plan holds (0 once it is closed)."""
        after = self._after
        return 0 if after is None or after._closed else after._held

    def close(self) -> None:
        """Stop fetching; what was fetched and not taken is dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for consumer in self._consumers:
            with contextlib.suppress(ValueError):
                consumer.plans.remove(self)
        self._poke()
        self._task.cancel()
        for future in self._futures:
            future.cancel()

    # -- the loop's side --------------------------------------------------------------
    async def _run(self) -> None:
        self._wake = asyncio.Event()
        running: set[asyncio.Task] = set()
        try:
            for i, (store, key, nbytes) in enumerate(self.entries):
                while True:
                    with self._lock:
                        if self._closed:
                            return
                        if self._state[i] == "skipped":
                            break
                        held = self._held + self._held_before()
                        room = held == 0 or held + nbytes <= self.max_bytes
                        if room and self._in_flight < self.max_requests:
                            self._state[i] = "launched"
                            self._held += nbytes
                            self._in_flight += 1
                            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
                            self.peak_bytes = max(self.peak_bytes, self._held)
                            break
                    self._wake.clear()
                    await self._wake.wait()
                if self._state[i] == "launched":
                    task = asyncio.ensure_future(self._one(i, store, key))
                    running.add(task)
                    task.add_done_callback(running.discard)
            self.launched_all = True  # the next plan may start (within what is left)
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        finally:
            for task in running:
                task.cancel()

    async def _one(self, i: int, store: Any, key: str) -> None:
        future = self._futures[i]
        try:
            data = await get_object(store, key)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:  # handed to the decode, which names the object
            if not future.cancelled():
                future.set_exception(exc)
        else:
            if data is None:
                with self._lock:
                    self.missing.append(key)
            if not future.cancelled():
                future.set_result(data)
        finally:
            with self._lock:
                self._in_flight -= 1
                self.fetched += 1
                taken = self._taken[i]
            if taken:
                self._release(i)
            else:
                self._poke()


class OpenedGroup:
    """The members of a remote zarr group a source reads, opened: what a worker needs
    instead of the group (``array_keys`` and ``[name]``), with no request to make."""

    def __init__(self, arrays: dict[str, Any]) -> None:
        self.arrays = arrays

    def array_keys(self) -> list[str]:
        return list(self.arrays)

    def __getitem__(self, name: str) -> Any:
        return self.arrays[name]


def opened_remote(opened: Any, arrays: Sequence[Any]) -> Any:
    """What to pickle of ``opened`` (a zarr Group or Array opened from a URL) so that a
    worker reads ``arrays`` without opening the store again (a zarr Array pickles as its
    metadata and its store: no request on unpickling): None for a local store (opening
    it is cheap, and the store may change between the driver's open and a worker's)."""
    import zarr

    if not isinstance(opened, (zarr.Array, zarr.Group)):
        return None
    if not is_remote(opened.store_path.store):
        return None
    if isinstance(opened, zarr.Array):
        return opened
    members = [a for a in arrays if isinstance(a, zarr.Array)]
    return OpenedGroup({a.basename: a for a in members})
