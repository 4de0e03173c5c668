"""Decoded storage chunks kept across reads within a byte budget: one cache per
``PatchSource`` in a process, shared by the chunk reader's decode threads, so a chunk
that the windows of several units reach into is decoded once.

With an epoch's plan (:meth:`ChunkCache.plan`: the stored keys each job of units will
decode, in the epoch's order, known before it starts: ``io.chunk_reader``), the cache
does not guess: a decoded chunk is kept only while a later read still needs it, and
dropped at its last use; when the budget is full, the chunk whose next use is furthest
away goes first, or the new one is not kept if its own is (Belady's optimal policy).
Memory is then what the coming units share, not the budget, and each chunk is decoded
once per epoch whenever the chunks shared between units in flight fit the budget.
Without a plan (reads outside an epoch), least recently used first out.

Two threads that need the same chunk at once: the first decodes it, the second waits
for that decode (:meth:`ChunkCache.acquire`) instead of decoding it again.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

DEFAULT_CHUNK_CACHE_MB = 256


class Decoding:
    """A chunk another thread is decoding: :meth:`wait` for it (None: its decode failed,
    decode it yourself)."""

    def __init__(self) -> None:
        self.chunk: np.ndarray | None = None
        self._done = threading.Event()

    def finish(self, chunk: np.ndarray | None) -> None:
        self.chunk = chunk
        self._done.set()

    def wait(self) -> np.ndarray | None:
        self._done.wait()
        return self.chunk


class CachePlan:
    """One epoch's reads: ``keys[unit]``, the stored keys unit ``unit`` decodes (in
    read order), for the units of ``jobs`` in order. A read of units tells the cache
    which job it serves with :meth:`reading`; :meth:`close` ends the plan."""

    def __init__(
        self, cache: ChunkCache, jobs: Sequence[Sequence[int]], keys: Mapping[int, Sequence[str]]
    ) -> None:
        self.cache = cache
        self.position = {int(u): j for j, job in enumerate(jobs) for u in job}
        uses: dict[str, list[int]] = {}
        for j, job in enumerate(jobs):
            for unit in job:
                for key in keys[int(unit)]:
                    uses.setdefault(key, []).append(j)
        self.uses = {key: deque(positions) for key, positions in uses.items()}
        self.reads = sum(len(p) for p in uses.values())  # chunk reads the plan holds

    def next_use(self, key: str) -> float:
        """The job that reads ``key`` next (inf: none)."""
        left = self.uses.get(key)
        return left[0] if left else float("inf")

    def use(self, key: str, position: int) -> None:
        """The read at job ``position`` took ``key``: one use fewer."""
        left = self.uses.get(key)
        if not left:
            return
        if left[0] == position:
            left.popleft()
        elif position in left:
            left.remove(position)
        else:
            left.popleft()  # a read the plan did not hold: count it against the next

    @contextlib.contextmanager
    def reading(self, units: Sequence[int]) -> Iterator[None]:
        """Reads on this thread inside the block serve the job holding ``units[0]``."""
        local = self.cache._local
        before = getattr(local, "read", None)
        local.read = (self, self.position.get(int(units[0]), -1) if len(units) else -1)
        try:
            yield
        finally:
            local.read = before

    def close(self) -> None:
        self.cache._end(self)


class ChunkCache:
    """Decoded chunks by stored key, at most ``max_bytes`` in all (0: keeps none).

    ``decodes_saved``: reads served from the cache or from another thread's decode;
    ``peak_bytes``: the most bytes held at once."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self.peak_bytes = 0
        self.decodes_saved = 0
        self._chunks: OrderedDict[str, np.ndarray] = OrderedDict()
        self._decoding: dict[str, Decoding] = {}
        self._plans: list[CachePlan] = []  # the last one decides what is kept
        self._lock = threading.Lock()
        self._local = threading.local()

    def plan(self, jobs: Sequence[Sequence[int]], keys: Mapping[int, Sequence[str]]) -> CachePlan:
        """Plan an epoch (see :class:`CachePlan`); from now on until it closes, what is
        kept is what its coming reads need."""
        plan = CachePlan(self, jobs, keys)
        with self._lock:
            self._plans.append(plan)
            self._trim()
        return plan

    def _end(self, plan: CachePlan) -> None:
        with self._lock:
            if plan in self._plans:
                self._plans.remove(plan)
                self._trim()

    def _trim(self) -> None:
        """Drop what the deciding plan never reads again (all of it: a plan closed)."""
        plan = self._plans[-1] if self._plans else None
        if plan is None:
            dropped = list(self._chunks)  # an epoch's chunks: the next plans its own
        else:
            dropped = [k for k in self._chunks if plan.next_use(k) == float("inf")]
        for key in dropped:
            self.nbytes -= self._chunks.pop(key).nbytes

    def _read(self) -> tuple[CachePlan | None, int]:
        """The plan this thread's read serves (None: not the deciding plan's) and its job."""
        plan, position = getattr(self._local, "read", None) or (None, -1)
        if plan is None or not self._plans or plan is not self._plans[-1]:
            return None, -1
        return plan, position

    def acquire(self, key: str) -> np.ndarray | Decoding | None:
        """``key``'s chunk if kept; a :class:`Decoding` if another thread is decoding it;
        None if the caller is to decode it, then :meth:`put` it (or :meth:`abandon`)."""
        plan, position = self._read()
        with self._lock:
            if plan is not None:
                plan.use(key, position)
            chunk = self._chunks.get(key)
            if chunk is not None:
                self.decodes_saved += 1
                if plan is not None and plan.next_use(key) == float("inf"):
                    self.nbytes -= self._chunks.pop(key).nbytes  # its last use
                elif not self._plans:
                    self._chunks.move_to_end(key)
                return chunk
            decoding = self._decoding.get(key)
            if decoding is not None:
                self.decodes_saved += 1
                return decoding
            self._decoding[key] = Decoding()
            return None

    def get(self, key: str) -> np.ndarray | None:
        """``key``'s chunk if kept (a use, as :meth:`acquire` counts one)."""
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None and not self._plans:
                self._chunks.move_to_end(key)
            return chunk

    def abandon(self, key: str) -> None:
        """The caller's decode of ``key`` failed: threads waiting for it decode it."""
        with self._lock:
            decoding = self._decoding.pop(key, None)
        if decoding is not None:
            decoding.finish(None)

    def put(self, key: str, chunk: np.ndarray) -> None:
        """Keep ``chunk`` (read-only from now on) if it is worth its bytes, and hand it
        to the threads waiting for it."""
        chunk.flags.writeable = False
        with self._lock:
            decoding = self._decoding.pop(key, None)
            self._keep(key, chunk)
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
        if decoding is not None:
            decoding.finish(chunk)

    def _keep(self, key: str, chunk: np.ndarray) -> None:
        if chunk.nbytes > self.max_bytes:
            return
        old = self._chunks.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        if not self._plans:  # least recently used first out
            self._chunks[key] = chunk
            self.nbytes += chunk.nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._chunks.popitem(last=False)
                self.nbytes -= dropped.nbytes
            return
        plan = self._plans[-1]
        mine = plan.next_use(key)
        if mine == float("inf"):
            return  # no later read needs it
        while self.nbytes + chunk.nbytes > self.max_bytes:
            furthest = max(self._chunks, key=plan.next_use)
            if plan.next_use(furthest) <= mine:
                return  # every chunk kept is needed sooner than this one
            self.nbytes -= self._chunks.pop(furthest).nbytes
        self._chunks[key] = chunk
        self.nbytes += chunk.nbytes

    def __len__(self) -> int:
        return len(self._chunks)
