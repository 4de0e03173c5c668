"""Decoded storage chunks kept across reads, least recently used first out, within a
byte budget: one per ``PatchSource`` in a process, so a chunk that the windows of one
unit reach into is decoded once for the next units that touch it too (the blocks of a
shuffled epoch are ordered so that neighbours follow each other: ``io.windows``).

Shared by the chunk reader's decode threads: one lock around the bookkeeping; two
threads missing the same chunk at once both decode it (no waiting on each other).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

DEFAULT_CHUNK_CACHE_MB = 256


class ChunkCache:
    """Decoded chunks by stored key, at most ``max_bytes`` in all (0: keeps none)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._chunks: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self._chunks.move_to_end(key)
            return chunk

    def put(self, key: str, chunk: np.ndarray) -> None:
        """Keep ``chunk`` (read-only from now on), dropping the least recently used."""
        if chunk.nbytes > self.max_bytes:
            return
        chunk.flags.writeable = False
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._chunks[key] = chunk
            self.nbytes += chunk.nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._chunks.popitem(last=False)
                self.nbytes -= dropped.nbytes

    def __len__(self) -> int:
        return len(self._chunks)
