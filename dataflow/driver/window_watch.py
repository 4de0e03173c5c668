"""The executor's side of a window that failed: whether a member was lost (the
scheduler's word, within a grace, or a probe), the round's other failures gathered for
the machine to pick the root cause among, and, when a replica's wait for its peers
timed out with every worker alive, the round aborted and a replica that does not end
its window even then taken for hung. It only looks and waits; what follows is the
machine's decision (``driver/window_failures.py``).

A part of :class:`~dataflow.driver.executor.Executor` (its base class), using its
client, spec, members, windows and liveness checks."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import CancelledError
from typing import Any

from distributed import wait

from dataflow.core.errors import NonFiniteError, ReplicaError, as_replica_error
from dataflow.driver import events as ev
from dataflow.driver.membership import FAILURE_GRACE_S, Lost, exception_now, tell
from dataflow.driver.memory import is_out_of_memory
from dataflow.driver.root_cause import is_wait_timeout, may_echo_a_loss, names_the_data
from dataflow.runtime import tasks as remote

# A non-finite step stops every replica at once: how long the driver waits for the one
# whose batch held the NaN (its error names the samples) when another's came first
NON_FINITE_WAIT_S = 2.0


class WindowFailureWatch:
    # the executor's, used here
    client: Any
    spec: Any
    run_id: str
    generation: int
    members: tuple[str, ...]
    windows: dict[Any, tuple[int, int, int]]
    slot_of: dict[Any, int]
    queue: Any
    raise_if_lost: Any
    _exception: Any
    _worker: Any

    def _queue_window_failure(self, future: Any) -> None:
        """Queue ``WindowFailed`` for ``future``, the earliest window that failed, with
        every failure the round saw (or ``Lost`` when a member turns out gone)."""
        generation, rank, window = self.windows.pop(future)
        first = None if future.status == "cancelled" else self._exception(future)
        try:
            self._window_failure(future, generation, rank, window, first)
        except Lost as lost:
            if self._worker(rank) not in lost.workers:
                # A survivor's window failed (its collective, or the store's barrier, timed
                # out on the silent or hung member): after the loss, the machine hears of
                # it, so that under Async or Local it does not wait for a survivor to
                # finish that window without the lost replica (a release): it rolls back
                error = as_replica_error(first, rank, self._worker(rank)) if first else None
                lost.then = ev.WindowFailed(
                    generation, rank, window, error or ReplicaError(f"window {window} failed")
                )
            raise

    def _window_failure(
        self, future: Any, generation: int, rank: int, window: int, first: Any
    ) -> None:
        # A peer's death is the usual cause of a collective's error; an error of the
        # replica's own (out of memory, a non-finite step, bad data, a model's mistake)
        # is reported without waiting FAILURE_GRACE_S for the scheduler's word of a loss.
        own = is_out_of_memory(first) or not may_echo_a_loss(first)
        seen_at = time.monotonic()
        self.raise_if_lost(grace=not own)
        failures: tuple[ev.WindowFailure, ...] = ()
        slow: tuple[int, ...] = ()
        if first is None:
            error: BaseException = ReplicaError(f"window {window} of replica {rank} was cancelled")
        elif isinstance(first, NonFiniteError):
            error = first
            # every replica stops at that step; the one whose batch held the NaN names the
            # samples (root_cause prefers it): its error is in within moments, if not first
            ranks = {r for _, r, _ in self.windows.values()} | {rank}
            if not names_the_data(first) and len(ranks) > 1:
                failures = self._failures(
                    future, rank, window, wait_s=NON_FINITE_WAIT_S, this_window=True
                )
        else:  # the machine picks the root cause among every failure seen
            error = as_replica_error(first, rank, self._worker(rank))
            # the peers had the grace to fail too: their errors are in, or they are slow
            rest_s = max(0.0, seen_at + FAILURE_GRACE_S - time.monotonic())
            failures = self._failures(future, rank, window, wait_s=0.0 if own else rest_s)
            if is_wait_timeout(error):
                slow = self._raise_if_hung()
        kind = isinstance(error, NonFiniteError), is_out_of_memory(error)
        self.queue.append(
            ev.WindowFailed(generation, rank, window, error, *kind, failures, slow=slow)
        )

    def _raise_if_hung(self) -> tuple[int, ...]:
        """A collective timed out with every worker alive: a peer was slow (the machine
        redoes the phase from the commit) or is hung. A slow peer, once it reaches its
        collective, fails within the timeout; a window still running after that long is
        hung, and its workers count as lost (``Lost``: excluded, the fit goes on). The
        running windows are aborted first (the machine stops them next either way): a
        replica waiting for its data, not in a collective (a store riding out an outage
        for its ``retry_s``), ends its wait then, and only one that does not is hung.
        Returns the ranks whose windows were still running (the slow replicas)."""
        running = [f for f in self.windows if not f.done()]
        slow = tuple(sorted({self.windows[f][1] for f in running}))
        if running:
            tell(
                self.client,
                remote.abort_run_soon,
                self.run_id,
                self.generation,
                workers=sorted({self.members[self.slot_of[f]] for f in running}),
            )
        with contextlib.suppress(TimeoutError, CancelledError):
            wait(running, timeout=self.spec.collective_timeout_s)
        hung = {self.members[self.slot_of[f]] for f in running if not f.done()}
        if hung:
            raise Lost(sorted(hung), silent_s=self.spec.collective_timeout_s)
        return slow

    def _failures(
        self, first: Any, rank: int, window: int, wait_s: float, this_window: bool = False
    ) -> tuple[ev.WindowFailure, ...]:
        """Every window failed once the others had ``wait_s`` more to fail too (what is
        left of the failure grace; none when ``first``'s error is the replica's own: the
        peers' echoes add nothing), each error as the fit reports it, for the machine to
        pick the root cause among (a peer's "connection closed" is only an echo).
        ``this_window``: only the other replicas' parts of ``first``'s window."""
        futures = {first: (self.generation, rank, window), **self.windows}
        if this_window:
            futures = {f: key for f, key in futures.items() if key[2] == window}
        with contextlib.suppress(TimeoutError, CancelledError):
            wait(list(futures), timeout=wait_s)
        failures = []
        for future, (_, r, w) in futures.items():
            if future.status != "error":
                continue
            raw = exception_now(future)
            error = None if raw is None else as_replica_error(raw, r, self._worker(r))
            kind = isinstance(error, NonFiniteError), is_out_of_memory(error)
            failures.append(ev.WindowFailure(w, r, error, *kind))
        return tuple(failures)
