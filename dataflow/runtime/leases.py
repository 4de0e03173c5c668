"""Sample leases: the parts of a window's batches handed out on demand, so a fast
replica takes over a slow one's remaining parts instead of waiting for it.

Each replica's parts of the window's steps form a deque on the fit's TCPStore (rank 0's
worker): the owner takes its next part from the front, a replica out of parts takes a
part from the back of the fullest deque. Every claim is one compare-and-set, so each
part is trained exactly once. The window's last step is never handed out: each replica
trains its own part of it (windows end at epoch ends, where its evaluation runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class WindowLeases:
    """The parts of steps ``[first, stop - 1)`` of one window, replica by replica."""

    def __init__(
        self, store: Any, key: str, *, first: int, stop: int, replicas: int, rank: int
    ) -> None:
        self.store, self.key, self.first, self.stop = store, key, first, stop
        self.replicas, self.rank = replicas, rank
        self.count = max(stop - first - 1, 0)  # the parts each replica may hand out

    def _deque(self, part: int) -> tuple[str, int, int, int]:
        key = f"{self.key}/{part}"
        # creates the deque [0, count) unless a replica did already; returns its state,
        # "front,back,changes,claimer": the change count and the claimer's rank make
        # every state unique, so a compare-and-set that lost a race never reads as won
        # (two thieves taking the same part would otherwise both find the state they
        # wanted: compare_set answers the value it finds)
        current = self.store.compare_set(key, "", f"0,{self.count},0,-1").decode()
        front, back, changes, _ = (int(v) for v in current.split(","))
        return current, front, back, changes

    def _claim(self, part: int, from_front: bool) -> int | None:
        key = f"{self.key}/{part}"
        while True:
            current, front, back, changes = self._deque(part)
            if front >= back:
                return None
            after = (front + 1, back) if from_front else (front, back - 1)
            wanted = f"{after[0]},{after[1]},{changes + 1},{self.rank}"
            if self.store.compare_set(key, current, wanted).decode() == wanted:
                return self.first + (front if from_front else back - 1)

    def take_own(self) -> int | None:
        """The next step of this replica's own parts, or None when none is left."""
        return self._claim(self.rank, from_front=True)

    def steal(self) -> tuple[int, int] | None:
        """(step, part) of another replica's last unclaimed part, from the replica with
        the most left; None when every deque is empty."""
        while True:
            left = []
            for part in range(self.replicas):
                if part != self.rank:
                    _, front, back, _ = self._deque(part)
                    if back > front:
                        left.append((back - front, part))
            if not left:
                return None
            for _, part in sorted(left, reverse=True):
                step = self._claim(part, from_front=False)
                if step is not None:
                    return step, part

    def tasks(self) -> Iterator[tuple[int, int | None]]:
        """What this replica trains, in order: (step, None) for its own parts, (step,
        part) for a part taken over; its own part of the last step comes last."""
        while (step := self.take_own()) is not None:
            yield step, None
        while (stolen := self.steal()) is not None:
            yield stolen
        yield self.stop - 1, None


def planned_tasks(first: int, stop: int) -> Iterator[tuple[int, int | None]]:
    """Without leases: every step of the window, this replica's own part."""
    for step in range(first, stop):
        yield step, None
