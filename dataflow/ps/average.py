"""Local updates' average at the parameter store: the period's end as a barrier that
survives a lost replica.

Under ``sync.Local`` each replica trains on its own for a period (one window), then all
replicas take the average of their states weighted by the samples each trained. Done as
an allreduce, one lost replica breaks the group, and every survivor rolls back to the
period's start. Done here, each replica hands in its state, the parts of the window it
trained and its samples (``average``); once every replica still in the fit did, and
every planned part of the window is covered, the shard answers all of them with the
weighted average. A replica the driver released as lost (``drop``) is not waited for:
a state it handed in before it died still counts (its parts are covered), else its
parts come back to the survivors as a *retrain round*: they train them on from their
own weights and hand in again. So the period is kept, and the lost replica costs only
what it trained and had not handed in. Like :class:`~dataflow.ps.shard.ParameterShard`
it lives in the host worker's plugin and runs on the registry's store loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.ps.shard import ShardError, WaitingShard


@dataclass
class HandedIn:
    """One replica's state at the end of its period (or of a retrain round)."""

    parts: frozenset[tuple[int, int]]  # (step, owner): the parts it trained
    samples: int  # the samples of those parts: its weight in the average
    state: torch.Tensor  # its averaged tensors, flat, float64
    parameters: int  # how many of ``state``'s leading elements are the parameters
    first_bad: int | None  # its first non-finite step of the window (None: none)


class AverageShard(WaitingShard):
    """The average of one fit's local updates: one shard, hosted by replica 0."""

    def __init__(self, *, window: int, incarnation: int, replicas: int, timeout_s: float) -> None:
        self.index = 0
        self.window, self.incarnation = window, incarnation
        self.replicas, self.timeout_s = replicas, timeout_s
        self.dropped: set[int] = set()
        self.held_out = {}
        self.error: str | None = None
        self.changed = asyncio.Condition()
        # by (window, round): what the replicas of that barrier take
        self.finals: dict[tuple[int, int], dict[str, Any]] = {}
        self._new_window()

    def _new_window(self) -> None:
        self.round = 0
        self.stop: int | None = None
        self.planned: set[tuple[int, int]] = set()
        self.handed: dict[int, HandedIn] = {}
        self.this_round: set[int] = set()  # who handed in during the current round

    # -- the replicas' calls (on the store loop) -----------------------------------------
    async def average(
        self, replica: int, window: int, stop: int, round: int, planned: Any, entry: HandedIn
    ) -> dict[str, Any]:
        """``replica`` hands in its state for round ``round`` of window ``window``; waits
        until the barrier settles, then returns the average or the parts to retrain."""
        async with self.changed:
            self._check()
            if replica in self.dropped:
                raise ShardError(f"replica {replica} handed in after it was dropped as lost")
            if round != self.round:
                raise ShardError(
                    f"replica {replica} handed in for round {round} of window {window}; the "
                    f"store is at round {self.round}"
                )
            self.stop = stop
            self.planned = {(int(s), int(o)) for s, o in planned}
            self.handed[replica] = entry
            self.this_round.add(replica)
            self._settle()
            await self._wait_for(lambda: (window, round) in self.finals)
            return self.finals[(window, round)]

    async def drop(self, replicas: Any) -> None:
        """The replicas' workers are lost: nobody waits for them. What they handed in
        for this window stays (their parts are done); their other parts are retrained."""
        async with self.changed:
            self.dropped.update(int(r) for r in replicas)
            self._settle()
            self.changed.notify_all()

    # -- inside ---------------------------------------------------------------------------
    def _settle(self) -> None:
        live = set(range(self.replicas)) - self.dropped
        if not live or not live <= self.this_round or self.stop is None:
            return
        key = (self.window, self.round)
        covered = set().union(*(entry.parts for entry in self.handed.values()))
        missing = self.planned - covered
        if missing:  # a lost replica's parts: the survivors train them and hand in again
            self.finals = {key: {"retrain": sorted(missing), "dropped": sorted(self.dropped)}}
            self.round += 1
            self.this_round = set()
        else:
            self.finals = {key: {**self._average(), "dropped": sorted(self.dropped)}}
            self.window = self.stop
            self._new_window()
        self.changed.notify_all()

    @torch.no_grad()
    def _average(self) -> dict[str, Any]:
        """The states weighted by samples, in replica order (the same bits for everyone);
        the drift of the parameters about their average; every first bad step."""
        order = sorted(self.handed)
        total = sum(self.handed[r].samples for r in order)
        weights = {r: self.handed[r].samples / total if total else 1.0 / len(order) for r in order}
        average: torch.Tensor | None = None
        for r in order:
            part = self.handed[r].state * weights[r]
            average = part if average is None else average.add_(part)
        assert average is not None
        n = self.handed[order[0]].parameters
        mean = average[:n]
        spread = sum(
            float((self.handed[r].state[:n] - mean).square().sum()) * weights[r] for r in order
        )
        norm = float(mean.square().sum())
        bad = {r: self.handed[r].first_bad for r in order if self.handed[r].first_bad is not None}
        return {
            "average": average,
            "drift": spread / norm if norm > 0 else 0.0,
            "first_bad": bad,
            "contributors": order,
        }

    def _timed_out(self) -> str:
        waiting = sorted(set(range(self.replicas)) - self.dropped - self.this_round)
        return (
            f"local updates' average waited {self.timeout_s:g} s for replicas {waiting} "
            "to end their period; a replica is lost or stuck (raise collective_timeout_s "
            "if periods are long)"
        )
