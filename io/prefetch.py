"""Background loading with a bounded queue, so reading overlaps compute.

Memory stays within ``depth`` batches whatever the dataset size. An exception in
the loader thread is re-raised in the consumer at the batch it belongs to. The
loader thread keeps no reference to a batch once it is queued, so a batch's output
buffer (``io.chunk_reader.BatchBuffers``) is free again as soon as the consumer
drops it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

_DONE = object()


class Prefetcher:
    """Runs ``load(item)`` for each item on a daemon thread, ``depth`` batches ahead."""

    def __init__(self, load: Callable[[Any], Any], items: Iterable[Any], *, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"Prefetcher depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(load, iter(items)), name="dataflow-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, entry: tuple[bool, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, load: Callable[[Any], Any], items: Any) -> None:
        try:
            for item in items:
                if self._stop.is_set():
                    return
                value = load(item)
                del item  # hold nothing once it is queued: the consumer decides its lifetime
                if not self._put((True, value)):
                    return
                del value
        except BaseException as exc:  # handed to the consumer, raised there
            self._put((False, exc))
            return
        self._put((True, _DONE))

    def get(self) -> Any:
        """The next loaded item; raises the loader's exception; StopIteration at the end."""
        ok, value = self._queue.get()
        if not ok:
            raise value
        if value is _DONE:
            raise StopIteration
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
