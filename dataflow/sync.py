"""When a window's results may commit: the synchronisation policy.

The fit state machine asks its policy before it commits a window. Synchronous
training (the only policy today) commits a window once every replica of the group
finished it, in window order: all replicas took the same steps on the same
weights. Asynchronous and local updates (replicas at different steps) plug in
here with their own rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SyncPolicy(Protocol):
    """Decides from the results a window has so far whether it may commit."""

    def may_commit(self, results: Mapping[int, Any], replicas: int) -> bool: ...


@dataclass(frozen=True)
class Synchronous:
    """Every step's gradients meet in the weighted allreduce: a window commits when all
    ``replicas`` finished it (windows commit in order)."""

    def may_commit(self, results: Mapping[int, Any], replicas: int) -> bool:
        return len(results) == replicas
