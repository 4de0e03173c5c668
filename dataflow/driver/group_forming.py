"""How the executor forms a fit's process group on the workers: the spec scattered
once, rank 0's store opened, every rank set up (fresh) or regrouped (survivors keep
their state, joiners get rank 0's snapshot), and the forming abandoned on the
survivors when a member is lost meanwhile.

A part of :class:`~dataflow.driver.executor.Executor` (its base class), apart because
forming a group is its own protocol; it uses the executor's client, members, groups,
run id, spec and task submission (``send``, ``gather``, ``lost``)."""

from __future__ import annotations

import contextlib
from typing import Any

from dataflow.driver import commands as cmd
from dataflow.driver.membership import Lost
from dataflow.runtime import tasks as remote


class GroupForming:
    # the executor's, used here
    client: Any
    run_id: str
    spec: Any
    spec_future: Any
    generation: int
    members: tuple[str, ...]
    groups: dict[str, tuple[str, ...]]
    size: int
    last: list[Any]
    known: set[str]
    released: set[str]
    removals: Any
    windows: dict[Any, tuple[int, int, int]]
    slot_of: dict[Any, int]
    in_flight: list[tuple[Any, str]]

    def form_group(self, c: cmd.FormGroup) -> list[dict[str, Any]]:
        """Set up (``fresh``) or regroup the members; returns the new replicas' infos."""
        old = {a: r for r, a in enumerate(self.members)}
        groups = c.groups or tuple((m,) for m in c.members)
        self.groups.update({g[0]: g for g in groups})
        members = tuple(w for g in groups for w in g)
        self.members, self.generation = members, c.generation
        self.known.update(members)
        self.released = set()
        self.removals.watch(members)
        world = len(members)
        if c.fresh:  # no window of an older group is in flight any more
            self.windows, self.slot_of, self.in_flight = {}, {}, []
            self.scatter_spec(list(c.members[:1]) if c.restore or c.generation else None)
            self.last = [None] * world
            host, port = self._rendezvous(world)
            try:
                infos = self.gather([self._setup(r, host, port) for r in range(world)])
            except Lost:
                self._abort_forming(c.generation)
                raise
            return infos[:: self.size]  # one per replica: its leader's
        joining = set(c.joining)
        snapshot = None
        if joining:
            snapshot = self.send(
                remote.Capture(self.run_id, self.generation, "snapshot"),
                0,
                after=self.last[0],
                key=f"snapshot@replica0-{self.run_id}-g{c.generation}",
            )
        last = [self.last[old[a]] if a in old else None for a in members]
        self.last = last
        host, port = self._rendezvous(world)
        regroups = [
            self.send(
                remote.Regroup(self.run_id, c.generation, r, world, host, port),
                r,
                after=last[r],
                key=f"regroup@replica{r}-{self.run_id}-g{c.generation}",
            )
            for r, a in enumerate(members)
            if a not in joining
        ]
        setups = [
            self._setup(r, host, port, snapshot, spec=self.spec)
            for r, a in enumerate(members)
            if a in joining
        ]
        try:
            infos = self.gather(setups)
            self.gather(regroups)
        except Lost:
            self._abort_forming(c.generation)
            alive = [a for a in c.joining if a not in self.lost()]
            with contextlib.suppress(Exception):
                self.client.run(remote.close_run_soon, self.run_id, workers=alive, wait=False)
            raise
        self.last = [*regroups, *setups]
        return infos[:: self.size]

    def _abort_forming(self, generation: int) -> None:
        """A member was lost while group ``generation`` formed: the others stop waiting
        for it to arrive (not waiting for them: a worker that died unnoticed would stall
        it), so their workers are free for the next group at once."""
        alive = [a for a in self.members if a not in self.lost()]
        with contextlib.suppress(Exception):
            self.client.run(
                remote.abort_group_soon, self.run_id, generation, workers=alive, wait=False
            )

    def scatter_spec(self, workers: list[str] | None) -> None:
        """Send the replica spec once (to ``workers``, else to every member)."""
        try:
            [self.spec_future] = self.client.scatter(
                [self.spec], broadcast=True, workers=workers or list(self.members), hash=False
            )
        except Exception:
            self.raise_if_lost()  # a worker died meanwhile: recover, send again
            raise

    def _rendezvous(self, world: int) -> tuple[Any, Any]:
        """Rank 0's worker opens the store the group forms at."""
        if world == 1:
            return None, None
        future = self.client.submit(
            remote.open_rendezvous,
            self.run_id,
            world,
            self.spec.collective_timeout_s,
            self.generation,
            workers=[self.members[0]],
            allow_other_workers=False,
            pure=False,
            key=f"rendezvous-{self.run_id}-g{self.generation}",
        )
        [address] = self.gather([future])
        return address

    def _setup(self, rank: int, host: Any, port: Any, snapshot: Any = None, spec: Any = None):
        """``spec``: the ReplicaSpec itself for joiners (the copies scattered at the start
        may have died with their workers); by default the scattered one."""
        request = remote.Setup(self.run_id, self.generation, rank, len(self.members), host, port)
        return self.send(
            request,
            rank,
            snapshot=snapshot,
            spec=self.spec_future if spec is None else spec,
            key=f"setup@replica{rank}-{self.run_id}-g{self.generation}",
        )
