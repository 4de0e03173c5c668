"""Which of a window round's failures caused the others, pure.

When one replica fails, its peers' collectives fail after it ("connection closed by
peer"), each a :class:`~dataflow.core.errors.CollectiveError`, and their parameter-store
calls fail with the failed replica's reason (a ``ShardError``, "replica 0 failed in
window 2: ..."): only echoes. The fit reports the first real failure: the earliest
(window, rank) whose error is not an echo, else the earliest of the echoes. The
executor reports every failure it saw (``WindowFailed.failures``); the machine picks
the one it acts on (:func:`acted_on`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from dataflow.core.errors import CollectiveError
from dataflow.driver import events as ev

# Errors that report another replica's failure. Named, not imported: pure.
_ECHOES = {"CollectiveError", "ShardError"}


def is_echo(error: Any) -> bool:
    """Whether ``error`` only reports a peer's failure (its collective or the store).
    An error copied into the driver log (``log.ErrorInfo``) names its classes in
    ``kinds``, so a replayed fit picks the same root cause."""
    if isinstance(error, BaseException):
        kinds = [kind.__name__ for kind in type(error).__mro__]
    else:
        kinds = list(getattr(error, "kinds", ()))
    return any(kind in _ECHOES for kind in kinds)


def acted_on(event: ev.WindowFailed) -> ev.WindowFailed:
    """``event`` as the failure the machine acts on: the rank, error and kind of the
    root cause among ``event.failures`` (:func:`root_cause`); the window stays the one
    that failed first (the one the machine waits for). As is when no failure's error
    could be read (or the executor reported none: the failure is its own cause)."""
    chosen = root_cause([((f.window, f.rank), f.error) for f in event.failures])
    if chosen is None:
        return event
    cause = event.failures[chosen]
    return dataclasses.replace(
        event,
        rank=cause.rank,
        error=cause.error,
        non_finite=cause.non_finite,
        out_of_memory=cause.out_of_memory,
    )


# A replica whose own batch held the NaN says so (``held_out_checks.non_finite_inputs``);
# its peers, which only received the non-finite reduced gradient, cannot
_NAMES_THE_DATA = re.compile(r"data holds NaN or inf")


def root_cause(failures: Sequence[tuple[tuple[int, int], Any]]) -> int | None:
    """The index in ``failures`` (``((window, rank), error)``, an error None where it
    could not be read) of the one to report; None when no error could be read. Among the
    earliest window's real failures, one that names the data behind a non-finite step
    goes first (every replica stops at that step; one of them holds the bad samples)."""
    readable = sorted((key, i) for i, (key, error) in enumerate(failures) if error is not None)
    real = [(key, i) for key, i in readable if not is_echo(failures[i][1])]
    chosen = (real or readable)[:1]
    if not chosen:
        return None
    window = chosen[0][0][0]
    for (w, _), i in real:
        if w == window and names_the_data(failures[i][1]):
            return i
    return chosen[0][1]


def names_the_data(error: Any) -> bool:
    """Whether ``error`` (or its ``log.ErrorInfo``) names the samples whose data made a
    step non-finite: the replica that read them says so, its peers cannot."""
    return _NAMES_THE_DATA.search(str(error)) is not None


# Errors a replica raises when a peer or the cluster went away under it: a collective's
# or a store's connection closed or timed out. Any of them may be the echo of a worker
# the scheduler has not yet reported lost. Named, not imported: pure.
_MAY_ECHO_A_LOSS = {
    "CollectiveError",
    "ShardError",  # the parameter store: "replica 1 failed in window 2"
    "DistError",  # torch.distributed's own, and its subclasses below
    "DistBackendError",
    "DistStoreError",
    "DistNetworkError",
    "OSError",
    "ConnectionError",
    "ConnectionResetError",
    "BrokenPipeError",
    "TimeoutError",
    "CommClosedError",
    "CancelledError",
}


# A plain RuntimeError is both gloo's word for a vanished peer ("[.../gloo/transport/
# tcp/pair.cc:534] Connection closed by peer", "Timed out waiting 20000ms for recv") and
# torch's for a model's mistake ("mat1 and mat2 shapes cannot be multiplied"): only the
# first kind, told by its message, may echo a loss.
_COMMUNICATION = re.compile(
    r"gloo|nccl|connect|socket|peer|timed? ?out|broken pipe|reset|closed|store|"
    r"rendezvous|process ?group|abort",
    re.IGNORECASE,
)


def may_echo_a_loss(error: BaseException | None) -> bool:
    """Whether ``error`` may be a peer's death seen from a survivor, so that the driver
    should give the scheduler a moment to report the loss before calling it a failure.
    None (a cancelled task) may; an error of the replica's own (bad data, a model's
    mistake such as a shape mismatch, a non-finite step, out of memory) does not, and
    is reported at once (the grace is seconds a user waits for a typo's traceback)."""
    if error is None:
        return True
    kinds = [kind.__name__ for kind in type(error).__mro__[:-2]]
    if any(kind in _MAY_ECHO_A_LOSS for kind in kinds):
        return True
    if kinds[0] == "OutOfMemoryError":  # a RuntimeError, but never a peer's
        return False
    return "RuntimeError" in kinds and _COMMUNICATION.search(str(error)) is not None


# What a collective says when it waited past ``collective_timeout_s`` (gloo: "Timed out
# waiting 30000ms for recv operation to complete"; NCCL's watchdog: "... operation timeout")
_TIMED_OUT = re.compile(r"timed out waiting|operation timeout|watchdog", re.IGNORECASE)
_COLLECTIVE = {"CollectiveError", "DistError", "DistBackendError", "RuntimeError"}
# What the parameter store (``Async``, ``Local``) says when one of its barriers waited
# past the same timeout: a shard's "... waited 30 s for replicas [1] ...", which every
# replica at that barrier reports (``ShardError``); or a replica's connection to the
# shard's host that got no reply in time (``PlaneError``, "...: timed out").
_STORE_WAITED = re.compile(r"\bwaited [0-9.e+]+ s for\b")
_PLANE_TIMED_OUT = re.compile(r"timed out", re.IGNORECASE)


def is_wait_timeout(error: Any) -> bool:
    """Whether ``error`` (an exception, or its ``log.ErrorInfo``) is a replica that waited
    for its peers past ``collective_timeout_s``, in a collective or at a barrier of the
    parameter store: when the executor finds every worker alive, a peer was slow to
    reach it (a data stall, a long pause), not lost."""
    if isinstance(error, BaseException):
        kinds = {kind.__name__ for kind in type(error).__mro__}
    else:
        kinds = set(getattr(error, "kinds", ()))
    text = str(error)
    if "ShardError" in kinds:
        return _STORE_WAITED.search(text) is not None
    if "PlaneError" in kinds:
        return _PLANE_TIMED_OUT.search(text) is not None
    return bool(kinds & _COLLECTIVE) and _TIMED_OUT.search(text) is not None


def stalled_error(error: Any, rank: int, stalls: int) -> BaseException:
    """The error a fit stops with when redoing the phase from the commit did not get
    past a wait for a live peer that timed out ``stalls`` times."""
    failure = CollectiveError(
        f"replica {rank} waited for its peers (in a collective or at the parameter "
        f"store's barrier) past collective_timeout_s ({error}), "
        f"after {stalls} redo(s) of this phase from its last commit, while every worker "
        "stayed alive: some replica's step takes longer than the timeout (a data stall: a "
        "store throttling or failing, its reads retried for the source's retry_s; a slow "
        "file system; a long pause). Raise Trainer(collective_timeout_s=...) above the "
        "longest stall, e.g. above the source's retry_s (or max_stalls, to redo the phase "
        "more often)"
    )
    # (a replayed log holds the error's name and message, not the exception)
    failure.__cause__ = error if isinstance(error, BaseException) else None
    return failure
