"""How the executor forms a fit's process group on the workers: the spec scattered
once (never inside a task: an in-memory source would travel through the scheduler in
every graph that carries it), rank 0's store opened, every rank set up (fresh) or
regrouped (survivors keep their state, joiners get rank 0's snapshot), and the forming
abandoned on the survivors when a member is lost meanwhile.

A part of :class:`~dataflow.driver.executor.Executor` (its base class), apart because
forming a group is its own protocol; it uses the executor's client, members, groups,
run id, spec and task submission (``send``, ``gather``, ``lost``)."""

from __future__ import annotations

import contextlib
from concurrent.futures import CancelledError
from typing import Any

from distributed import wait

from dataflow.driver import commands as cmd
from dataflow.driver.membership import FAILURE_GRACE_S, Lost, exception_now, tell, wait_some
from dataflow.driver.root_cause import may_echo_a_loss
from dataflow.runtime import tasks as remote
from dataflow.runtime.cluster import live_workers


class SetupRefused(Exception):
    """Workers whose setup raised an error of their own (``error``, the first's) while
    the others' did not: the loop makes it a ``SetupFailed`` event for the machine."""

    def __init__(self, workers: tuple[str, ...], error: BaseException) -> None:
        super().__init__(f"workers {list(workers)} failed to set up: {error!r}")
        self.workers, self.error = workers, error


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
    unwatched: set[str]
    removals: Any
    windows: dict[Any, tuple[int, int, int]]
    slot_of: dict[Any, int]
    in_flight: list[tuple[Any, str]]
    unreachable: set[str]

    def form_group(self, c: cmd.FormGroup) -> list[dict[str, Any]]:
        """Set up (``fresh``) or regroup the members; returns the new replicas' infos."""
        old = {a: r for r, a in enumerate(self.members)}
        groups = c.groups or tuple((m,) for m in c.members)
        self.groups.update({g[0]: g for g in groups})
        members = tuple(w for g in groups for w in g)
        self.members, self.generation = members, c.generation
        self.known.update(members)
        self.unwatched = set()
        self.removals.watch(members)
        world = len(members)
        if c.fresh:  # no window of an older group is in flight any more
            self.windows, self.slot_of, self.in_flight = {}, {}, []
            self.scatter_spec()
            self.last = [None] * world
            host, port = self._rendezvous(world)
            setups = [self._setup(r, host, port) for r in range(world)]
            try:
                self._await_setups(dict(zip(setups, members, strict=True)), [], every=True)
                infos = self.gather(setups)
            except (Lost, SetupRefused) as failed:
                self._abort_forming(c.generation, list(failed.workers))
                raise
            return infos[:: self.size]  # one per replica: its leader's
        joining = set(c.joining)
        snapshot = None
        if joining:
            self.scatter_spec()  # the joiners' Setup fetches it from a worker holding it
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
            self._setup(r, host, port, snapshot) for r, a in enumerate(members) if a in joining
        ]
        joiners = {f: a for f, a in zip(setups, (a for a in members if a in joining), strict=True)}
        try:  # together: a survivor's failed rendezvous ends the wait for a joiner's setup
            # that never runs (its inputs failed to reach its worker: Dask leaves it waiting)
            self._await_setups(joiners, regroups)
            infos = self.gather([*setups, *regroups])[: len(setups)]
        except (Lost, SetupRefused) as failed:
            self._abort_forming(c.generation, list(failed.workers))
            gone = {*self.lost(), *failed.workers}  # (silent ones too: not yet excluded)
            alive = [a for a in c.joining if a not in gone]
            refused = [a for a in c.joining if a in failed.workers and a not in self.lost()]
            tell(
                self.client,
                remote.close_run_soon,
                self.run_id,
                c.generation,
                workers=[*alive, *refused],
            )
            raise
        self.last = [*regroups, *setups]
        return infos[:: self.size]

    def _await_setups(
        self, setups: dict[Any, str], regroups: list[Any], *, every: bool = False
    ) -> None:
        """Wait for the ``setups`` (future -> worker) and the members' ``regroups``. A
        worker whose setup raised its own error (not an echo of a peer's loss) is refused
        at once: the others would wait for it in the rendezvous until the collective
        timeout. ``every`` (a first group: no worker is known to run the fit yet): the
        others' setups get ``FAILURE_GRACE_S`` to fail too, and when every one of them
        raised its own error, nothing is refused (the error is the fit's: ``gather``
        raises it). The forming is given up on them first: those that wait for the
        failed workers in the group's first collectives then fail at once (an echo),
        rather than hold the grace to its end; those that fail on their own still do."""
        pending = [*setups, *regroups]
        while pending:
            done, pending = wait_some(pending, self.removals.removed)
            own = _own_errors(setups, done)
            if own and every and pending:
                self._abort_forming(self.generation, [a for a, _ in own])
                with contextlib.suppress(TimeoutError, CancelledError):
                    wait(pending, timeout=FAILURE_GRACE_S)
                own = _own_errors(setups, list(setups))
            if own and every and len(own) == len(setups):
                return
            if own:
                self.raise_if_lost()  # a member lost meanwhile comes first
                raise SetupRefused(tuple(a for a, _ in own), own[0][1])
            if pending:
                self.raise_if_lost()

    def _abort_forming(self, generation: int, lost: list[str]) -> None:
        """A member was lost while group ``generation`` formed (``lost``: gone, or
        silent to the driver's probe): the others stop waiting for it to arrive (not
        waiting for them: a worker that died unnoticed would stall it), so their workers
        are free for the next group at once."""
        gone = {*self.lost(), *lost}
        alive = [a for a in self.members if a not in gone]
        tell(self.client, remote.abort_group_soon, self.run_id, generation, workers=alive)

    def scatter_spec(self) -> None:
        """The replica spec (its graph holds the sources: in-memory arrays, maybe GBs) on
        the cluster, sent from the driver once and never inside a task: one live member
        gets it, and every Setup depends on its future, so the other members, and
        workers joining later (elastic, a recovery, ``scale_with_batch``), fetch it from
        a worker holding a copy. Sent again only when no live worker holds one any more
        (their workers died): the driver still has the spec. Not a broadcast: the
        scheduler's replication to a list naming a worker that dies meanwhile retries
        that worker every connect timeout (30 s), forever, and the scatter with it; a
        dependency whose holder died fails its tasks, which the executor's wait turns
        into a lost member."""
        if self.spec_future is not None and self._spec_held():
            return
        live = live_workers(self.client)
        target = [w for w in self.members if w in live][:1]
        try:
            if not target:
                raise Lost([w for w in self.members if w not in live])
            [self.spec_future] = self.client.scatter(
                [self.spec], workers=target, hash=False, timeout=self.spec.collective_timeout_s
            )
        except Exception:
            self.raise_if_lost()  # a worker died meanwhile: recover, send again
            raise

    def _spec_held(self) -> bool:
        """Whether a live member of the group still holds the scattered spec (Dask cannot
        compute it again: scattered data lost with its last holder is gone). Only a
        member counts: the setups' wait reads a member's death as a loss, but a holder
        outside the group (a worker excluded as hung, still alive) that dies meanwhile
        only cancels the setups that fetch from it, a loss of nobody's."""
        if self.spec_future.status != "finished":
            return False
        try:
            holders = self.client.who_has([self.spec_future]).get(self.spec_future.key, ())
        except Exception:
            return False
        live = live_workers(self.client)
        return any(w in live and w in self.members and w not in self.unreachable for w in holders)

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

    def _setup(self, rank: int, host: Any, port: Any, snapshot: Any = None):
        """Rank ``rank``'s Setup, on the scattered spec (``scatter_spec`` first)."""
        request = remote.Setup(self.run_id, self.generation, rank, len(self.members), host, port)
        return self.send(
            request,
            rank,
            snapshot=snapshot,
            spec=self.spec_future,
            key=f"setup@replica{rank}-{self.run_id}-g{self.generation}",
        )


def _own_errors(setups: dict[Any, str], done: Any) -> list[tuple[str, BaseException]]:
    """(worker, error) of each finished setup that raised an error of its own."""
    return [
        (setups[f], error)
        for f in done
        if f in setups and f.status == "error" and not may_echo_a_loss(error := exception_now(f))
    ]
