"""Background loading with a bounded queue, so reading overlaps compute.

Memory stays within ``depth`` batches whatever the dataset size. An exception in
the loader thread is re-raised in the consumer at the batch it belongs to. The
loader thread keeps no reference to a batch once it is queued, so a batch's output
buffer (``io.batch_buffers.BatchBuffers``) is free again as soon as the consumer
drops it.

A loader closed while interrupted is not waited for (its item may be a read stuck for
minutes), but it must end before the interpreter does: a daemon thread still inside a
torch call when the interpreter finalizes is ended with ``pthread_exit`` through C++
frames, and the whole process aborts ("terminate called without an active exception",
SIGABRT; a worker process of dask-mpi exits that way). Such loaders are joined at
exit, for at most ``EXIT_JOIN_S``, the way ``concurrent.futures`` joins its workers.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

_DONE = object()
INTERRUPT_POLL_S = 0.1  # how soon a waiting ``get`` sees an interrupt
EXIT_JOIN_S = 30.0  # the longest the interpreter's exit waits for loaders left running
# Loader threads a close left running (process-wide, as the threads are): joined at exit
_left_running: set[threading.Thread] = set()
_left_running_lock = threading.Lock()


def _join_left_running() -> None:
    """At interpreter exit: wait for the loaders closed while busy to end their item."""
    deadline = time.monotonic() + EXIT_JOIN_S
    with _left_running_lock:
        threads = list(_left_running)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


atexit.register(_join_left_running)


class Prefetcher:
    """Runs ``load(item)`` for each item on a daemon thread, ``depth`` batches ahead."""

    def __init__(self, load: Callable[[Any], Any], items: Iterable[Any], *, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"Prefetcher depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._interrupted: BaseException | None = None
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
            self._load_all(load, items)
        finally:
            with _left_running_lock:
                _left_running.discard(threading.current_thread())

    def _load_all(self, load: Callable[[Any], Any], items: Any) -> None:
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
        """The next loaded item; raises the loader's exception; StopIteration at the end;
        the :meth:`interrupt` error once interrupted while it waits (or after), also in
        place of a loader's exception then (a read the interrupt abandoned failed)."""
        if self._interrupted is not None:  # (also over items loaded ahead)
            raise self._interrupted
        try:
            ok, value = self._queue.get_nowait()  # the usual case: loaded ahead
        except queue.Empty:
            ok, value = self._wait()
        if not ok:
            interrupted = self._interrupted
            if interrupted is not None:  # (an abandoned read's failure: the interrupt's)
                raise interrupted from value
            raise value
        if value is _DONE:
            raise StopIteration
        return value

    def _wait(self) -> tuple[bool, Any]:
        """The next entry, waited for; an interrupt ends the wait (a read riding out a
        store outage can take minutes, and the window that waits must not outlive it)."""
        while True:
            if self._interrupted is not None:
                raise self._interrupted
            try:
                return self._queue.get(timeout=INTERRUPT_POLL_S)
            except queue.Empty:
                continue

    def interrupt(self, error: BaseException) -> None:
        """From another thread: a ``get`` waiting now, or any later one, raises ``error``
        (the loader thread goes on; :meth:`close` stops it)."""
        self._interrupted = error

    def close(self) -> None:
        """Stop the loader thread after its current item. Waits for it (5 s at most),
        unless interrupted: then its item may be a read stuck for minutes, and the
        replica must go on without it (batch buffers are reused only once unreferenced,
        so a late item harms nothing). One left running is joined at the interpreter's
        exit."""
        self._stop.set()
        self._thread.join(timeout=0 if self._interrupted is not None else 5)
        if self._thread.is_alive():
            with _left_running_lock:
                _left_running.add(self._thread)
