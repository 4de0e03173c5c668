"""The fit machine's log: what it was told and what it decided, as plain data, bounded.

Each entry is an event the machine handled and the commands it gave, both as
*loggable copies*: an exception becomes its type name and message
(:class:`ErrorInfo`), and a replica's state returned for a checkpoint becomes a marker
(:data:`STATE_TAKEN`), so nothing in the log holds a live object that others change
afterwards (the recorder drops each window's state once it is written) or keeps
megabytes of weights alive. ``dataflow.driver.machine.replay`` feeds the events to a
fresh machine, which gives the same commands: a fit's decisions can be replayed from its
log (``FitResult.driver_log``), as distributed replays a worker's stimulus log.

The log is a ring: it keeps the newest entries whose size (one per entry plus one per
replica result it holds) stays within ``limit``, so a fit of 1,024 replicas keeps about
100 window rounds and one of 2 replicas about 30,000; a fit shorter than that replays
from its start (``dropped`` is 0). Pure: no torch, Dask or I/O.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

LOG_LIMIT = 100_000  # entries plus the replica results they hold (see the docstring)
STATE_TAKEN = "<replica state>"  # a replica's state (weights) went with this result


@dataclass(frozen=True)
class ErrorInfo:
    """An exception in the log: its type's name and its message."""

    type: str
    message: str

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        return cls(type(error).__name__, str(error))


def loggable(item: Any) -> Any:
    """A copy of an event or command holding plain data only (see the module docstring);
    the item itself where it already does."""
    if not dataclasses.is_dataclass(item):
        return item
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(item):
        value = getattr(item, f.name)
        if isinstance(value, BaseException):
            changes[f.name] = ErrorInfo.of(value)
        elif f.name == "results" and isinstance(value, dict):  # WindowDone
            if any(_holds_state(r) for r in value.values()):
                changes[f.name] = {rank: _plain_result(r) for rank, r in value.items()}
        elif f.name == "results" and isinstance(value, tuple):  # CommitWindow
            if any(_holds_state(r) for r in value):
                changes[f.name] = tuple(_plain_result(r) for r in value)
        elif f.name == "states" and value is not None:  # WriteCheckpoint
            changes[f.name] = _states_taken(value)
    return dataclasses.replace(item, **changes) if changes else item


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


class DriverLog:
    """The ring of (event, commands) entries of one fit, with the machine's ``config``
    (what a replay needs); ``limit``: see the module docstring."""

    def __init__(self, config: Any, limit: int = LOG_LIMIT) -> None:
        self.config, self.limit = config, limit
        self.entries: deque[tuple[Any, tuple[Any, ...]]] = deque()
        self._sizes: deque[int] = deque()
        self._size = 0
        self.dropped = 0  # entries the ring let go (0: the log starts at the fit's start)

    def record(self, event: Any, commands: list[Any]) -> None:
        size = 1 + len(getattr(event, "results", ()) or ())
        self.entries.append((loggable(event), tuple(loggable(c) for c in commands)))
        self._sizes.append(size)
        self._size += size
        while self._size > self.limit and len(self.entries) > 1:
            self.entries.popleft()
            self._size -= self._sizes.popleft()
            self.dropped += 1

    @property
    def events(self) -> list[Any]:
        return [event for event, _ in self.entries]

    @property
    def commands(self) -> list[Any]:
        """Every command, in the order given."""
        return [c for _, commands in self.entries for c in commands]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        return iter(self.entries)
