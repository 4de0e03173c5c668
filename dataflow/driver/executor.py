"""The only code on the driver that talks to Dask.

It carries out the state machine's cluster commands (form a group, begin a phase,
submit windows, stop, roll back, end the phase, gather replica states, restore,
take the final weights) and turns what happens into events: a window's result or
failure (futures keyed by generation, rank and window), a lost or a new worker
(the scheduler asked directly, every ``LIVENESS_POLL_S`` while waiting, and at once
when the scheduler reports a member removed). A task pinned to a worker that died
never runs, so every wait watches the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

from distributed import Client

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.arrivals import WorkerArrivals
from dataflow.driver.group_forming import GroupForming
from dataflow.driver.membership import (
    FAILURE_GRACE_S,
    LIVENESS_POLL_S,
    PROBE_S,
    Lost,
    RemovalWatch,
    ResultReader,
    ask,
    exception_now,
    tell,
    unreachable,
    wait_some,
)
from dataflow.driver.root_cause import may_echo_a_loss
from dataflow.driver.window_watch import WindowFailureWatch
from dataflow.runtime import tasks as remote
from dataflow.runtime.cluster import live_workers


class Executor(GroupForming, WorkerArrivals, WindowFailureWatch):
    """Runs one fit's cluster commands on ``client``; ``spec`` is the ReplicaSpec."""

    def __init__(self, client: Client, spec: Any) -> None:
        self.client, self.spec, self.run_id = client, spec, spec.run_id
        self.queue: deque[Any] = deque()
        self.members: tuple[str, ...] = ()
        self.generation = 0
        self.last: list[Any] = []  # per rank, its last task: the next one runs after it
        self.windows: dict[Any, tuple[int, int, int]] = {}  # future -> (generation, rank, window)
        self.in_flight: list[tuple[Any, str]] = []  # what a stop must wait for
        self.known: set[str] = set()  # workers seen (members or reported as joined)
        self.spec_future: Any = None
        self._serial = 0
        # A replica is a group of ``size`` workers (a spatial layout): tasks go to every
        # worker of it; ``members`` lists the workers, replica r's at [r*size, (r+1)*size).
        self.size = getattr(getattr(spec, "layout", None), "spatial", 1) or 1
        self.groups: dict[str, tuple[str, ...]] = {}  # leader -> its group's workers
        self.slot_of: dict[Any, int] = {}  # window future -> the worker (slot) it ran on
        # members the machine released (cmd.ReleaseReplicas: it handled their loss and
        # waits on nothing of theirs); their loss is not reported again
        self.unwatched: set[str] = set()
        self.removals = RemovalWatch(client)  # the scheduler's word of a lost member
        self.reader = ResultReader(client)  # finished windows' results, read in one go
        # members the driver could not reach after a failed collective (a cut link, a
        # hung node): lost, whatever the scheduler still says; those of them not excluded
        # for good are asked at each phase's choice whether they are back (``arrivals``)
        self.unreachable: set[str] = set()
        self.may_return: set[str] = set()

    # -- liveness -----------------------------------------------------------------------
    def lost(self) -> list[str]:
        """Members gone (whether the fit recovers from that is the machine's decision)."""
        self.removals.removed.clear()
        alive = live_workers(self.client)
        return [
            a
            for a in self.members
            if (a not in alive or a in self.unreachable) and a not in self.unwatched
        ]

    def raise_if_lost(self, grace: bool = False) -> None:
        """Raise :class:`Lost` if a member is gone. With ``grace`` (a task just failed,
        maybe because a peer died) wait a little for the scheduler to notice, then ask
        the members directly: those that do not answer are reported silent (a cut link
        or a hung node sends no reset, and the scheduler's verdict can take minutes;
        whether they are lost is the machine's rule, ``cmd.ExcludeWorkers`` its word)."""
        deadline = time.monotonic() + (FAILURE_GRACE_S if grace else 0.0)
        while True:
            lost = self.lost()
            if lost:
                raise Lost(lost)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if grace:
            silent = unreachable(self.client, [a for a in self.members if a not in self.unwatched])
            if silent:
                raise Lost(silent, silent_s=PROBE_S)

    def exclude(self, workers: tuple[str, ...], for_good: bool = False) -> None:
        """``cmd.ExcludeWorkers``: ``workers`` count as gone from now on; unless
        ``for_good``, :meth:`arrivals` asks whether they are back."""
        self.unreachable.update(workers)
        if not for_good:
            self.may_return.update(workers)
        else:
            self.may_return.difference_update(workers)

    def is_loss(self, error: BaseException) -> bool:
        """Whether ``error`` is this layer's signal of a lost member (``carry_out`` turns
        it into a WorkersLost event; the loop lets it through)."""
        return isinstance(error, Lost)

    def carry_out(self, effects: Callable[[], None]) -> bool:
        """Carry out one command's ``effects``. A member lost meanwhile (seen while the
        command waited on Dask) becomes a WorkersLost event in the queue, after what the
        survivors finished first; False tells the loop to stop the command list there.
        (``Lost`` is this layer's own signal: it never leaves the executor.)"""
        try:
            effects()
        except Lost as lost:
            self.queue_lost(lost.workers, lost.silent_s, then=lost.then)
            return False
        return True

    def queue_lost(self, lost: list[str], silent_s: float | None = None, then: Any = None) -> None:
        """A WorkersLost event, or WorkersSilent for members silent ``silent_s`` to the
        probe, after what the survivors finished and the workers that joined; then
        ``then`` (a survivor's window that failed on the loss)."""
        self._harvest(lost)  # what the survivors finished commits before the loss is handled
        joined = self.joined_event()  # a nanny's replacement may already be there
        if joined is not None:
            self.queue.append(joined)
        gone = tuple(lost)
        event = ev.WorkersLost(gone) if silent_s is None else ev.WorkersSilent(gone, silent_s)
        self.queue.append(event)
        if then is not None:
            self.queue.append(then)

    # -- waiting --------------------------------------------------------------------------
    def gather(self, futures: list[Any]) -> list[Any]:
        """``client.gather`` that cannot hang on a dead worker."""
        pending, graced = list(futures), False
        while pending:
            done, pending = wait_some(pending, self.removals.removed)
            failed = [f for f in done if f.status == "error"]
            if failed or pending:  # a failure's grace once: the others' errors follow
                # (none for an error of the task's own: a model factory's, a source's)
                echo = any(may_echo_a_loss(exception_now(f)) for f in failed)
                self.raise_if_lost(grace=echo and not graced)
                graced = graced or bool(failed)
        return [self._result(f) for f in futures]

    def _result(self, future: Any) -> Any:
        while True:
            try:
                return future.result(timeout=LIVENESS_POLL_S)
            except TimeoutError:
                self.raise_if_lost()
            except CancelledError:  # its inputs died with a worker: that worker is lost
                self.raise_if_lost(grace=True)
                raise

    def _exception(self, future: Any) -> BaseException | None:
        """A failed future's exception, without hanging: a task whose worker died after
        it finished reads as failed, then as "lost" (the scheduler waits to recompute it
        on its dead worker), and ``future.exception()`` would wait for that forever."""
        while True:
            try:
                return future.exception(timeout=LIVENESS_POLL_S)
            except TimeoutError:
                self.raise_if_lost(grace=True)
            except CancelledError:
                return None

    def events(self):
        """The fit's events, as they happen: queued ones first, then window results."""
        while True:
            if self.queue:
                yield self.queue.popleft()
                continue
            if not self.windows:  # every command answers with an event, or windows run
                raise RuntimeError("the fit's driver has no event to wait for (a bug)")
            try:
                self._poll_windows()
            except Lost as lost:
                self.queue_lost(lost.workers, lost.silent_s, then=lost.then)

    def _poll_windows(self) -> None:
        # A finished window may wait here for its group's other workers (spatial layouts):
        # wait on the rest, and harvest whatever finished.
        running = [f for f in self.windows if f.status != "finished"]
        done = wait_some(running, self.removals.removed)[0] if running else []
        if not done and running:
            queued = len(self.queue)
            self._harvest()  # a window that finished before the wait began
            if len(self.queue) == queued:
                self.raise_if_lost()
                joined = self.joined_event()
                self.queue.append(joined or ev.Timer())
            return
        self._harvest()  # every result first: a loss then salvages all it can
        failed = sorted(
            (f for f in done if f in self.windows and f.status != "finished"),
            key=lambda f: self.windows[f][2],
        )
        if failed:
            self._queue_window_failure(failed[0])

    def _harvest(self, lost: list[str] = ()) -> None:
        """Queue the result of every window that finished, in window order, whatever
        became of its workers since (which results the fit uses is the machine's
        decision), except what cannot be read: a result held on a ``lost`` worker (the
        leader's; for a mid-phase checkpoint every worker's part) died with it, and so
        did one on a worker that died unnoticed (``read_now`` leaves it out at once)."""
        finished = [f for f in self.windows if f.status == "finished"]
        parts: dict[tuple[int, int, int], list[Any]] = {}
        for future in finished:
            parts.setdefault(self.windows[future], []).append(future)
        gone = set(lost)
        complete = []  # (generation, rank, window, its futures in slot order)
        for (generation, rank, window), futures in sorted(parts.items(), key=lambda i: i[0][2]):
            if len(futures) < self.size or gone.intersection(self._slots_of(rank)[:1]):
                continue  # the group's other workers still run it, or its result died
            futures.sort(key=lambda f: self.slot_of.get(f, 0))
            complete.append((generation, rank, window, futures))
        read = self.reader.read([futures[0] for *_, futures in complete])  # the leaders'
        if self.size > 1:  # a mid-phase checkpoint keeps every worker's part
            held = [
                f
                for _, rank, _, futures in complete
                if getattr(read.get(futures[0].key), "checkpoint", None) is not None
                and not gone.intersection(self._slots_of(rank))
                for f in futures[1:]
            ]
            read.update(self.reader.read(held))
        by_window: dict[tuple[int, int], dict[int, Any]] = {}
        for generation, rank, window, futures in complete:
            if any(f.key not in read for f in self._needed(futures, read)):
                continue  # its worker died (or a part of a group's checkpoint did)
            result = read[futures[0].key]
            if result.checkpoint is not None and self.size > 1:
                # (random state, buffers) as a phase-boundary one does: in slot order
                result.checkpoint = tuple(read[f.key].checkpoint for f in futures)
            for future in futures:
                del self.windows[future]
                self.slot_of.pop(future, None)
            by_window.setdefault((generation, window), {})[rank] = result
        for (generation, window), results in by_window.items():
            self.queue.append(ev.WindowDone(generation, window, results))
        # Release what finished: the client holds no committed window's result (nor the
        # mid-phase checkpoint state it may carry) past this point.
        self.in_flight = [(f, a) for f, a in self.in_flight if not f.done()]

    def _needed(self, futures: list[Any], read: dict) -> list[Any]:
        """What a window's result needs read: its leader's, and with a spatial group's
        mid-phase checkpoint every worker's part."""
        leader = read.get(futures[0].key)
        if self.size > 1 and getattr(leader, "checkpoint", None) is not None:
            return futures
        return futures[:1]

    def _worker(self, rank: int) -> str:
        slot = rank * self.size
        return self.members[slot] if slot < len(self.members) else "?"

    def _slots_of(self, rank: int) -> tuple[str, ...]:
        return tuple(self.members[rank * self.size : (rank + 1) * self.size])

    def _workers_of(self, leaders: tuple[str, ...]) -> tuple[str, ...]:
        """Every worker of the replicas led by ``leaders``, in slot order."""
        return tuple(w for leader in leaders for w in self.groups.get(leader, (leader,)))

    def _addressed(self, c: cmd.StopWindows | cmd.RollBack) -> tuple[str, ...]:
        """The workers a stop or a rollback goes to: its groups' when it names them (a
        spatial layout's partners of a lost worker, each alone), else its members'."""
        if c.groups:
            return tuple(w for group in c.groups for w in group)
        return self._workers_of(c.members)

    # -- commands -------------------------------------------------------------------------
    def send(self, request: Any, rank: int, *, key: str, after: Any = None, **extra: Any) -> Any:
        """Submit ``request`` to replica ``rank``'s worker, behind ``after``."""
        future = self.client.submit(
            remote.handle,
            request,
            after,
            **extra,
            workers=[self.members[rank]],
            allow_other_workers=False,
            pure=False,
            key=key,
        )
        self.in_flight.append((future, self.members[rank]))  # what a recovery must stop
        return future

    def serial(self) -> int:
        """A number for task keys that are submitted again (a key must be new)."""
        self._serial += 1
        return self._serial

    def tag(self) -> str:
        return f"-g{self.generation}" if self.generation else ""

    def restore(self, state: Any, rngs: list, buffers: list) -> None:
        """Every replica takes a checkpoint's weights, optimizer state and stage settings
        (``state``, a ReplicaState), and, with as many replicas as were saved, its own
        random state and buffers."""
        same_world = len(buffers) == len(self.members)

        def restore(r: int) -> remote.Restore:
            rng = rngs[r] if r < len(rngs) else None
            own = dataclasses.replace(state, rng=rng, buffers=buffers[r] if same_world else None)
            return remote.Restore(self.run_id, self.generation, own)

        self.gather(self._each(restore, "restore", after=False))

    def _each(self, make: Any, name: str, *, after: bool = True) -> list[Any]:
        """``make(rank)``'s request sent to every replica's worker, behind its last task
        (``after``), under a new key."""
        return [
            self.send(
                make(r),
                r,
                after=self.last[r] if after else None,
                key=f"{name}@replica{r}-{self.run_id}{self.tag()}-{self.serial()}",
            )
            for r in range(len(self.members))
        ]

    def begin_phase(self, c: cmd.BeginPhase, context: Any) -> None:
        request = remote.BeginPhase(self.run_id, c.generation, context)
        self.last = self._each(lambda r: request, f"begin-phase-p{c.phase.index}")

    def submit_windows(self, c: cmd.SubmitWindows) -> None:
        plan = c.plan
        for task in plan.tasks(c.queued_windows()):
            window = task.window
            first = plan.steps[window.first].index
            stop = plan.steps[window.stop - 1].index + 1
            checkpoint, weights = window.index in c.checkpoints, window.index in c.weights
            run = remote.RunWindow(self.run_id, c.generation, first, stop, checkpoint, weights)
            for part in range(self.size):  # every worker of the replica's group
                slot = task.replica * self.size + part
                future = self.send(
                    run,
                    slot,
                    after=self.last[slot],
                    key=task.key if part == 0 else f"{task.key}-part{part}",
                )
                self.last[slot] = future
                self.slot_of[future] = slot
                self.windows[future] = (c.generation, task.replica, c.first_window + window.index)

    def stop(self, c: cmd.StopWindows) -> None:
        """The addressed replicas leave their windows; waits (at most the collective
        timeout) for their running tasks to end. One of their workers lost meanwhile is
        reported at once: its task never ends, and waiting the whole timeout for it
        would only delay the recovery that loss needs."""
        addressed = self._addressed(c)
        if c.leave_group:  # not waiting: a worker that died unnoticed would stall it
            tell(
                self.client,
                remote.abort_run_soon,
                self.run_id,
                self.generation,
                workers=list(addressed),
            )
        running = [f for f, address in self.in_flight if address in addressed and not f.done()]
        # Dropped, not cancelled: cancelling a chain of dependent futures can trip the
        # scheduler; a dropped task that still runs finds a newer generation and refuses.
        self.in_flight, self.windows, self.slot_of = [], {}, {}
        deadline = time.monotonic() + self.spec.collective_timeout_s
        while running and time.monotonic() < deadline:
            running = wait_some(running, self.removals.removed)[1]
            gone = [a for a in self.lost() if a in addressed] if running else []
            if gone:
                raise Lost(gone)

    def hold(self, c: cmd.HoldWindows) -> None:
        """A stop: the addressed replicas start no more windows (the running ones go
        on); every window finished by then is queued, then ``WindowsHeld``, so the
        machine commits them before it rolls back. A replica that does not answer is
        looked for among the lost."""
        addressed = list(self._workers_of(c.members))  # (a spatial group's every worker)
        held = ask(
            self.client,
            remote.hold_run,
            self.run_id,
            self.generation,
            workers=addressed,
            timeout_s=PROBE_S,
        )
        if len(held) < len(addressed):
            self.raise_if_lost()
        self._harvest()
        self.queue.append(ev.WindowsHeld())

    def release(self, c: cmd.ReleaseReplicas) -> None:
        """The survivors finish window ``c.window`` without the lost replicas: their
        futures, and every later window's (which the survivors skip), are dropped from
        what the driver waits on; the survivors' workers are told (not waiting: a
        worker that died unnoticed would stall it)."""
        self.unwatched.update(c.workers)
        self.windows = {
            f: key for f, key in self.windows.items() if key[1] not in c.lost and key[2] <= c.window
        }
        self.slot_of = {f: slot for f, slot in self.slot_of.items() if f in self.windows}
        survivors = list(self._workers_of(c.members))
        tell(
            self.client,
            remote.release_replicas,
            self.run_id,
            c.generation,
            list(c.lost),
            c.stop_step,
            workers=survivors,
        )

    def roll_back(self, c: cmd.RollBack) -> None:
        self.members = self._addressed(c)
        futures = [
            self.send(
                remote.RollBack(self.run_id, self.generation, c.step, r, c.leave_group),
                r,
                key=f"rollback@replica{r}-{self.run_id}-{self.serial()}",
            )
            for r in range(len(self.members))
        ]
        self.gather(futures)
        self.last = futures

    def end_phase(self, c: cmd.EndPhase) -> None:
        request = remote.EndPhase(self.run_id, c.generation)
        ends = self.gather(self._each(lambda r: request, "end-phase"))
        self.in_flight = []
        self.queue.append(ev.PhaseEnded(c.generation, tuple(ends[:: self.size])))

    def replica_states(self, tag: str) -> list[Any]:
        """Every replica's part of a checkpoint, after its last task (rank 0's first)."""
        request = remote.Capture(self.run_id, self.generation, "checkpoint")
        return self.gather(self._each(lambda r: request, f"checkpoint-{tag}"))

    def final_weights(self, what: str = "weights") -> dict[str, Any] | None:
        """Rank 0's final weights, or (``what="averaged"``) their moving average."""
        request = remote.Capture(self.run_id, self.generation, what)
        key = f"{what}@replica0-{self.run_id}{self.tag()}-{self.serial()}"
        [state] = self.gather([self.send(request, 0, key=key)])
        return state

    def close(self, *, failed: bool) -> None:
        """Release the fit's futures and its replicas on the workers still alive (a
        broadcast to a dead worker's address waits the whole connect timeout, 30 s)."""
        members = list(self.members)
        with contextlib.suppress(Exception):
            live = live_workers(self.client)
            members = [a for a in members if a in live and a not in self.unreachable]
        if failed:
            with contextlib.suppress(Exception):
                self.client.run(remote.abort_run, self.run_id, workers=members)
        self.in_flight, self.windows, self.last = [], {}, []
        self.spec_future = None  # the workers may drop the scattered spec (and its sources)
        with contextlib.suppress(Exception):
            self.client.run(remote.close_run, self.run_id, workers=members)
        self.removals.close()
