"""The executor's watch on the fit's workers: waits on futures that end early when the
scheduler reports a member removed.

The scheduler logs a ``remove-worker`` event on the topic named by the worker's
address; the driver subscribes to its members' topics. Without it, a loss that fails
no task (replicas waiting on a parameter store, local steps before the average) is
noticed only at the next liveness poll (``LIVENESS_POLL_S``). Part of the executor:
the one place on the driver that talks to Dask.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import CancelledError
from typing import Any

from distributed import wait

LIVENESS_POLL_S = 1.0  # how often the driver checks that the fit's workers are alive
FAILURE_GRACE_S = 5.0  # how long to wait for the other replicas' errors after the first
# a member that does not answer the driver within this long, when a collective failed and
# the scheduler names no loss, is lost (a cut link sends no reset; Dask's own verdict
# waits for the worker's time to live and a connect timeout: minutes by default)
PROBE_S = 5.0
# how long an excluded worker has to answer whether it is idle again, at a phase's
# choice: one still unreachable costs the fit this much per phase
IDLE_PROBE_S = 1.0
WAKE_POLL_S = 0.05  # how soon a wait notices the scheduler's report of a removed member


class RemovalWatch:
    """``removed`` is set when the scheduler reports a watched worker removed; whoever
    then asks the scheduler who is alive clears it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.removed = threading.Event()
        self.watched: set[str] = set()

    def watch(self, workers: tuple[str, ...]) -> None:
        for address in workers:
            if address not in self.watched:
                self.watched.add(address)
                with contextlib.suppress(Exception):
                    self.client.subscribe_topic(address, self._on_event)

    def _on_event(self, event: Any) -> None:
        _, message = event
        if isinstance(message, dict) and message.get("action") == "remove-worker":
            self.removed.set()

    def close(self) -> None:
        for address in self.watched:
            with contextlib.suppress(Exception):
                self.client.unsubscribe_topic(address)
        self.watched = set()


def wait_some(futures: list[Any], woken: threading.Event | None = None) -> tuple[list, list]:
    """The futures done within ``LIVENESS_POLL_S`` (maybe none), and the others; sooner
    once ``woken`` is set (a member removed: the caller asks who is alive)."""
    deadline = time.monotonic() + LIVENESS_POLL_S
    while True:
        left = deadline - time.monotonic()
        timeout = LIVENESS_POLL_S if woken is None else min(WAKE_POLL_S, max(left, 0.001))
        try:
            wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")
        except (TimeoutError, CancelledError):  # distributed.wait raises where concurrent's
            pass  # returns; a cancelled future (its inputs died with a worker) is done
        done = [f for f in futures if f.done()]
        if done or woken is None or woken.is_set() or time.monotonic() >= deadline:
            return done, [f for f in futures if not f.done()]


def read_now(client: Any, futures: list[Any], timeout_s: float = LIVENESS_POLL_S) -> dict | None:
    """The results of the finished ``futures`` that can be read now, by key, in one
    request to the scheduler (a second without the keys it could not gather): a result
    whose worker died is left out at once, whether the scheduler has removed that
    worker yet or not. ``future.result(timeout)`` would wait its whole timeout on each
    such future: the client resets a future it could not read and waits for a
    recomputation that, pinned to the dead worker, never comes. A request that times
    out (a hung worker, or results too large to move in ``timeout_s``) reads nothing and
    returns None; the caller looks again at its next poll, with a longer timeout."""
    keys = [f.key for f in futures if f.status == "finished"]
    for _ in range(2):
        if not keys:
            return {}
        try:
            answer = client.sync(client.scheduler.gather, keys=keys, callback_timeout=timeout_s)
        except TimeoutError:
            return None
        except Exception:  # the scheduler is gone: nothing read this time
            return {}
        if answer.get("status") == "OK":
            return dict(answer["data"])
        failed = set(answer.get("keys", ()))
        keys = [k for k in keys if k not in failed]
    return {}


class ResultReader:
    """:func:`read_now` with a timeout that doubles (to a minute) while reads time out,
    back to a second after one succeeds: a result carrying a large checkpoint may take
    longer than a second to move, and must not be asked for again and again, a second
    at a time, never arriving."""

    def __init__(self, client: Any, longest_s: float = 60.0) -> None:
        self.client = client
        self.longest_s = longest_s
        self.timeout_s = LIVENESS_POLL_S

    def read(self, futures: list[Any]) -> dict:
        read = read_now(self.client, futures, self.timeout_s)
        if read is None:
            self.timeout_s = min(self.longest_s, 2 * self.timeout_s)
            return {}
        self.timeout_s = LIVENESS_POLL_S
        return read


def unreachable(client: Any, workers: list[str], timeout_s: float = PROBE_S) -> list[str]:
    """The ``workers`` that do not answer the driver's identity call within
    ``timeout_s`` (asked all at once, each on its own connection)."""

    async def silent(address: str) -> str | None:
        try:
            await asyncio.wait_for(client.rpc(address).identity(), timeout_s)
        except Exception:  # timed out, refused, reset: no answer
            return address
        return None

    async def probe_all() -> list[str]:
        answers = await asyncio.gather(*(silent(a) for a in workers))
        return [a for a in answers if a is not None]

    return client.sync(probe_all) if workers else []


def idle_workers(client: Any, workers: list[str], timeout_s: float = IDLE_PROBE_S) -> list[str]:
    """The ``workers`` that answer within ``timeout_s`` with no task running on them (a
    task the driver let go of still counts while its thread runs): asked each on its own,
    on the worker's event loop, which answers even while a task thread is stuck."""

    async def idle(address: str) -> str | None:
        try:
            answer = await asyncio.wait_for(
                client.run(_running_tasks, workers=[address], asynchronous=True), timeout_s
            )
        except Exception:  # timed out, refused, reset: not back
            return None
        return address if answer.get(address) == 0 else None

    async def ask_all() -> list[str]:
        answers = await asyncio.gather(*(idle(a) for a in workers))
        return [a for a in answers if a is not None]

    return client.sync(ask_all) if workers else []


def _running_tasks(dask_worker: Any) -> int:
    """On a worker: the tasks whose threads run now, cancelled ones included."""
    state = dask_worker.state
    return state.executing_count + len(state.long_running)


def tell(client: Any, function: Any, *args: Any, workers: list[str]) -> None:
    """Run ``function`` on ``workers``' event loops (``client.run(wait=False)``) without
    the driver waiting: the scheduler's broadcast retries a worker that died unnoticed
    for the whole connect timeout (30 s by default) and ``client.run`` waits for it even
    with ``wait=False``. A worker that cannot be reached is skipped."""
    if not workers:
        return

    async def send() -> None:
        with contextlib.suppress(Exception):
            await client.run(
                function,
                *args,
                workers=list(workers),
                wait=False,
                on_error="ignore",
                asynchronous=True,
            )

    client.loop.add_callback(send)


class Lost(Exception):
    """Internal: workers of the fit are gone while a command waited on them;
    ``silent_s``: not by the scheduler's word but silent to the driver's probe for that
    long (a WorkersSilent event: whether that is a loss is the machine's rule)."""

    def __init__(self, workers: list[str], silent_s: float | None = None) -> None:
        super().__init__(f"lost workers {workers}")
        self.workers, self.silent_s = workers, silent_s
        self.then: Any = None  # an event to queue after the loss's (the executor's)


def exception_now(future: Any) -> BaseException | None:
    """The exception of a future that read as failed; None if it no longer does (its
    worker died since, and the scheduler waits to recompute it)."""
    try:
        return future.exception(timeout=LIVENESS_POLL_S)
    except (TimeoutError, CancelledError):
        return None


def ask(client: Any, function: Any, *args: Any, workers: list[str], timeout_s: float) -> list[str]:
    """Run ``function`` on each of ``workers``' event loops and wait for it there (each
    at most ``timeout_s``); returns those that answered."""

    async def one(address: str) -> str | None:
        try:
            call = client.run(function, *args, workers=[address], asynchronous=True)
            await asyncio.wait_for(call, timeout_s)
        except Exception:  # timed out, refused, reset
            return None
        return address

    async def every() -> list[str]:
        return [a for a in await asyncio.gather(*(one(a) for a in workers)) if a is not None]

    return client.sync(every) if workers else []
