"""Ride out a store that fails for a while: read again, backing off, for ``retry_s``.

An object store shared by a cluster throttles readers that ask too fast (S3's
``SlowDown``), answers some requests with a server error, and drops connections; each
passes. The cloud client retries on its own for a while (botocore and s3fs for up to
about 30 s, a 500 for about 10 s; fsspec's HTTP not at all), and then the read fails:
one throttled GET on one worker would stop a fit of hours. So a source's reads go on
retrying such a failure (``io.store_access.UNAVAILABLE``) with exponential backoff and
jitter (as the AWS SDKs do, so workers throttled together do not return together)
until ``retry_s`` seconds have passed since the first failure; then the read fails
with a :class:`~dataflow.core.errors.StoreUnavailableError` naming the object, the
store, the worker and how long it tried. Any other failure (a missing object, a corrupt
chunk, no credentials) is not retried: no retry mends it.

:func:`backoff_s` and :func:`gives_up` are the decisions, pure; :class:`StoreRetry`
applies them to a call, counting what it retried (``retries``, reported per phase as
``store_retries`` in the history); :func:`open_with_retries` does the same for a
source's opening on the driver (its metadata's reads).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dataflow.core.errors import ConfigError, StoreAccessError
from dataflow.io.store_access import RETRIED, UNAVAILABLE, access_failure, store_access_error

log = logging.getLogger(__name__)

# A replica riding out a failing store keeps its peers waiting in their allreduce: past
# the trainer's collective_timeout_s (default 30 s) the phase's rest is redone from the
# last commit (a "stalled" failure), past twice that the replica is dropped as hung
DEFAULT_RETRY_S = 120.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
WARN_EVERY_S = 30.0  # a worker's log says a store is failing at most this often

T = TypeVar("T")


def retry_seconds(who: str, value: Any) -> float:
    """``value`` (a source's ``retry_s``) as a float, or a ConfigError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(
            f"{who}(retry_s={value!r}): how long a read retries a store that fails in a way "
            "that passes (throttling, a server error, a dropped connection); use a number "
            f">= 0 of seconds (0: fail at the first such error; default {DEFAULT_RETRY_S:g})"
        )
    return float(value)


def backoff_s(attempt: int, draw: float) -> float:
    """The wait before retry ``attempt`` (1, 2, ...): "full jitter", ``draw`` (uniform in
    [0, 1)) times a cap doubling from FIRST_BACKOFF_S to MAX_BACKOFF_S."""
    cap = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (attempt - 1))
    return draw * cap


def gives_up(kind: str | None, elapsed_s: float, wait_s: float, retry_s: float) -> bool:
    """Whether a read that failed with ``kind`` (``access_failure``), ``elapsed_s`` after
    its first failure, stops instead of retrying after ``wait_s`` more."""
    return kind != UNAVAILABLE or elapsed_s + wait_s > retry_s


_scope = threading.local()  # the event that abandons this thread's reads (if any)


@contextlib.contextmanager
def abandoned_when(event: threading.Event) -> Iterator[None]:
    """Reads on this thread inside the block stop retrying once ``event`` is set: the
    reader they read for is gone (a window the driver aborted while its replica rode
    out an outage). Its failure is then raised at once, instead of the thread sending
    GETs to a failing store, for nobody, until ``retry_s`` runs out."""
    previous = getattr(_scope, "event", None)
    _scope.event = event
    try:
        yield
    finally:
        _scope.event = previous


class StoreRetry:
    """Runs reads of one store, each retried while it fails transiently for at most
    ``retry_s`` seconds (or until the thread's reads are abandoned, ``abandoned_when``);
    thread-safe (decode threads share one). ``retries``: the reads sent again so far."""

    def __init__(
        self,
        retry_s: float = DEFAULT_RETRY_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.retry_s = float(retry_s)
        self.retries = 0
        self._clock = clock
        self._sleep = sleep
        self._draw = random.Random().random  # timing only: no result depends on it
        self._lock = threading.Lock()
        self._warned_at: float | None = None

    def run(self, read: Callable[[], T]) -> T:
        """``read()``, sent again while it fails transiently; the last failure raised with
        how long it was retried set on it (``store_access.RETRIED``, which the error
        naming it says) once the time is spent."""
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                return read()
            except Exception as exc:
                now = self._clock()
                first_failure = now if first_failure is None else first_failure
                attempt += 1
                with self._lock:
                    wait = backoff_s(attempt, self._draw())
                abandon = getattr(_scope, "event", None)
                if abandon is not None and abandon.is_set():
                    raise
                if gives_up(access_failure(exc), now - first_failure, wait, self.retry_s):
                    if attempt > 1:
                        setattr(exc, RETRIED, (attempt - 1, now - first_failure))
                    raise
                with self._lock:
                    self.retries += 1
                    warn = self._warned_at is None or now - self._warned_at >= WARN_EVERY_S
                    self._warned_at = now if warn else self._warned_at
                if warn:  # in the worker's log as it happens, not only when it gives up
                    log.warning(
                        "dataflow: a store read failed in a way that passes (%s: %s); "
                        "sending it again (%d retries by this source so far, for at most "
                        "retry_s=%g s per read)",
                        type(exc).__name__,
                        str(exc)[:200],
                        self.retries,
                        self.retry_s,
                    )
                if abandon is None:
                    self._sleep(wait)
                elif abandon.wait(wait):  # abandoned while it waited
                    raise

    def __getstate__(self) -> dict[str, Any]:  # a copy on a worker counts its own
        return {"retry_s": self.retry_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["retry_s"])


def open_with_retries(open_: Callable[[], T], retry_s: float, who: str, store: Any) -> T:
    """``open_()`` (a source reading ``store``'s metadata), tried again while it fails in
    a way that passes for ``retry_s``; then, or for a refusal, a StoreAccessError naming
    ``who`` and the store (an error the opening named itself stands)."""
    try:
        return StoreRetry(retry_s).run(open_)
    except StoreAccessError:
        raise
    except Exception as exc:
        refused = store_access_error(who, store, None, exc)
        if refused is None:
            raise
        raise refused from exc
