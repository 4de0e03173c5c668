"""The fit machine's log: what it was told and what it decided, as plain data, bounded.

Each entry is an event the machine handled, the commands it gave, and how many of
them the executor carried out (a loss on the way stops the rest), the event and
commands as *loggable copies*, by a rule each type declares (:data:`LOGGED_AS`; a type
without one cannot be logged): an exception becomes its type name and message
(:class:`ErrorInfo`), and a replica's state returned for a checkpoint becomes a marker
(:data:`STATE_TAKEN`), so nothing in the log holds a live object that others change
afterwards (the recorder drops each window's state once it is written) or keeps
megabytes of weights alive. The poll (``Timer``) is not logged. ``dataflow.driver.
machine.replay`` feeds the events to a fresh machine, which gives the same commands: a
fit's decisions can be replayed from its log (``FitResult.driver_log``, or
``error.driver_log`` of the error a failed fit raises), as distributed replays a
worker's stimulus log.

The log is a ring: it keeps the newest entries whose size (one per entry plus one per
replica result or window failure it holds) stays within ``limit``, so a fit of 1,024
replicas keeps about 100 window rounds and one of 2 replicas about 30,000; a fit
shorter than that replays from its start (``dropped`` is 0). Pure: no torch, Dask or
I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev

LOG_LIMIT = 100_000  # entries plus the replica results they hold (see the docstring)
STATE_TAKEN = "<replica state>"  # a replica's state (weights) went with this result


@dataclass(frozen=True)
class ErrorInfo:
    """An exception in the log: its type's name, its message, and the names of its
    classes (``kinds``: what the machine's root-cause choice reads, so a replay picks
    the same failure)."""

    type: str
    message: str
    kinds: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        kinds = tuple(kind.__name__ for kind in type(error).__mro__[:-1])  # (not object)
        return cls(type(error).__name__, str(error), kinds)


def loggable(item: Any) -> Any:
    """A copy of an event or command holding plain data only (see the module docstring),
    by its type's rule in :data:`LOGGED_AS`; a type without one is a ``TypeError`` (a new
    event or command says how it is logged before it reaches a log)."""
    rule = LOGGED_AS.get(type(item))
    if rule is None:
        raise TypeError(
            f"{type(item).__name__} has no rule for the driver log: add one to "
            "dataflow.driver.log.LOGGED_AS (as is, or what to replace in it)"
        )
    return rule(item)


def _as_is(item: Any) -> Any:
    """Plain data already (numbers, names, phase and step specs)."""
    return item


def _error_as_info(item: Any) -> Any:
    """Its ``error`` as type name and message (an exception holds frames and locals)."""
    error = getattr(item, "error", None)
    if isinstance(error, BaseException):
        return dataclasses.replace(item, error=ErrorInfo.of(error))
    return item


def _failures_as_info(item: Any) -> Any:
    """``WindowFailed``: its error and each of its ``failures``' as :class:`ErrorInfo`."""
    item = _error_as_info(item)
    if not item.failures:
        return item
    failures = tuple(
        f._replace(error=ErrorInfo.of(f.error)) if isinstance(f.error, BaseException) else f
        for f in item.failures
    )
    return dataclasses.replace(item, failures=failures)


def _results_without_state(item: Any) -> Any:
    """``WindowDone``/``CommitWindow``: each result with a replica state (the weights a
    mid-phase checkpoint takes) as the marker :data:`STATE_TAKEN`."""
    results = item.results
    values = results.values() if isinstance(results, dict) else results
    # one C-level pass (map, list.count) over what may be 1,024 results a window
    taken = list(map(getattr, values, itertools.repeat("checkpoint"), itertools.repeat(None)))
    if taken.count(None) + taken.count(STATE_TAKEN) == len(taken):
        return item
    if isinstance(results, dict):
        return dataclasses.replace(item, results={k: _plain_result(r) for k, r in results.items()})
    return dataclasses.replace(item, results=tuple(_plain_result(r) for r in results))


def _states_as_markers(item: Any) -> Any:
    """``WriteCheckpoint``, ``KeepIfBest``: the states it takes as markers."""
    return (
        item
        if item.states is None
        else dataclasses.replace(item, states=_states_taken(item.states))
    )


def _holds_state(result: Any) -> bool:
    return getattr(result, "checkpoint", None) not in (None, STATE_TAKEN)


def _plain_result(result: Any) -> Any:
    if not _holds_state(result):
        return result
    return dataclasses.replace(result, checkpoint=STATE_TAKEN)


def _states_taken(states: Any) -> Any:
    if isinstance(states, tuple):
        return tuple(_states_taken(s) for s in states)
    return None if states is None else STATE_TAKEN


# How each event and command goes into the log. Timer is not logged at all: a poll
# decides nothing and would crowd real events out of the ring.
LOGGED_AS: dict[type, Callable[[Any], Any]] = {
    ev.Started: _as_is,
    ev.EpochReviewed: _as_is,
    ev.GroupFormed: _as_is,
    ev.GroupFailed: _error_as_info,
    ev.SetupFailed: _error_as_info,
    ev.PhaseChosen: _as_is,
    ev.SegmentPlanned: _as_is,
    ev.WindowDone: _results_without_state,
    ev.WindowFailed: _failures_as_info,
    ev.PhaseEnded: _as_is,
    ev.WorkersLost: _as_is,
    ev.WorkersSilent: _as_is,
    ev.WorkersJoined: _as_is,
    ev.WorkersRecovered: _as_is,
    ev.RestartPoint: _as_is,
    ev.CommitRefused: _error_as_info,
    ev.StopRequested: _as_is,
    ev.WindowsHeld: _as_is,
    cmd.FormGroup: _as_is,
    cmd.ChoosePhase: _as_is,
    cmd.ScaleCluster: _as_is,
    cmd.PlanSegment: _as_is,
    cmd.BeginPhase: _as_is,
    cmd.SubmitWindows: _as_is,
    cmd.CommitWindow: _results_without_state,
    cmd.WriteCheckpoint: _states_as_markers,
    cmd.KeepIfBest: _states_as_markers,
    cmd.HoldWindows: _as_is,
    cmd.StopWindows: _as_is,
    cmd.ExcludeWorkers: _as_is,
    cmd.ReadmitWorkers: _as_is,
    cmd.ReleaseReplicas: _as_is,
    cmd.RollBack: _as_is,
    cmd.EndPhase: _as_is,
    cmd.RecordPhase: _as_is,
    cmd.RecordFailure: _as_is,
    cmd.AwaitRestart: _as_is,
    cmd.Restart: _as_is,
    cmd.Fail: _error_as_info,
    cmd.Finish: _as_is,
}
NOT_LOGGED = (ev.Timer,)


@dataclass
class LogEntry:
    """An event, the commands the machine gave for it, and how many of them were carried
    out (fewer when a loss on the way stopped the list; None: not reported yet)."""

    event: Any
    commands: tuple[Any, ...]
    carried_out: int | None = None


class DriverLog:
    """The ring of :class:`LogEntry` of one fit, with the machine's ``config`` (what a
    replay needs); ``limit``: see the module docstring."""

    def __init__(self, config: Any, limit: int = LOG_LIMIT) -> None:
        self.config, self.limit = config, limit
        self.entries: deque[LogEntry] = deque()
        self._sizes: deque[int] = deque()
        self._size = 0
        self.dropped = 0  # entries the ring let go (0: the log starts at the fit's start)

    def record(self, event: Any, commands: list[Any]) -> None:
        if isinstance(event, NOT_LOGGED):
            return
        held = len(getattr(event, "results", ()) or ()) + len(getattr(event, "failures", ()))
        size = 1 + held
        entry = LogEntry(loggable(event), tuple(loggable(c) for c in commands))
        self.entries.append(entry)
        self._sizes.append(size)
        self._size += size
        while self._size > self.limit and len(self.entries) > 1:
            self.entries.popleft()
            self._size -= self._sizes.popleft()
            self.dropped += 1

    def carried_out(self, count: int) -> None:
        """The executor carried out the first ``count`` commands of the newest entry."""
        if self.entries:
            self.entries[-1].carried_out = count

    @property
    def events(self) -> list[Any]:
        return [entry.event for entry in self.entries]

    @property
    def commands(self) -> list[Any]:
        """Every command, in the order given."""
        return [c for entry in self.entries for c in entry.commands]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        return ((entry.event, entry.commands) for entry in self.entries)
