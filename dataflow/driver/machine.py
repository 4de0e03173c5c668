"""The fit as a pure state machine: events in, commands out.

``FitMachine.handle(event) -> list[Command]`` owns every decision of a fit on the
driver: who is a member (and the process-group generation), where the phase
stands, which windows commit and in what order (and which a lost replica's
partners let us salvage), what a lost worker, a NaN or a lost cluster leads to
(roll back, regroup, restart from a checkpoint, fail), the restart and rollback
budgets, ``min_workers``, when joiners join, and when checkpoints are written.
It holds no Dask, torch, clock or I/O: the executor carries the commands out and
turns what happens into events, and ``replay`` rebuilds a machine from its log.
The model is distributed's ``WorkerState.handle_stimulus``.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dataflow.core.errors import ReplicaError
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.fit_settings import WorkerScaling, more_workers
from dataflow.driver.log import DriverLog
from dataflow.driver.memory import (
    largest_planned,
    measured_cap,
)
from dataflow.driver.recovery import LostWorkers
from dataflow.driver.state import (
    AfterGroup,
    FitState,
    Forming,
    PhasePosition,
    Status,
    validate_state,
)
from dataflow.driver.stopping import StopOnSignal
from dataflow.driver.transitions import Ignored, rule
from dataflow.driver.window_failures import WindowFailures
from dataflow.driver.window_planning import WindowPlanning
from dataflow.planning.layout import ReplicaGroups
from dataflow.sync import Synchronous, SyncPolicy


@dataclass(frozen=True, kw_only=True)
class MachineConfig:
    """The fit's rules, fixed for its length."""

    stage_names: tuple[str, ...] = ("step",)
    run_id: str = ""
    window_seconds: float = 1.0
    window_steps: int | None = None  # fixed steps per window (no calibration)
    calibration_steps: int = 2  # 1-step windows measured before steps are fused
    min_workers: int = 1
    recover_lost_workers: bool = True
    roll_back_non_finite: bool = False  # on_non_finite="rollback"
    max_rollbacks: int = 3  # per phase
    lr_cut: float = 0.5  # the LR factor applied per rollback
    max_memory_halvings: int = 4  # per phase: out-of-memory errors the fit recovers from
    max_stalls: int = 3  # per phase: collectives timed out on a slow (live) peer
    max_restarts: int = 3  # from one checkpoint, when every replica is lost
    max_group_retries: int = 3  # a group that fails to form with no member lost
    restart_wait_s: float = 60.0  # every replica lost: how long to wait for min_workers
    restart_gather_s: float = 10.0  # ... then for as many as the fit had (restarts straggle)
    checkpoints: bool = False  # a checkpoint folder was given
    checkpoint_every: int | None = None  # windows between mid-phase checkpoints
    may_join: bool = True  # workers that join the client join the fit
    max_replicas: int | None = None  # the most replicas joins may grow the fit to
    spatial: int = 1  # workers per replica (Layout.spatial): groups form from P workers
    epochs: int | None = None  # the fit's length; None: until the schedule has no phase
    # fit(on_epoch=...): plans end at epoch ends, and the next waits for the epoch's
    # EpochReviewed (a callback may stop the fit there)
    epoch_review: bool = False
    # fit(keep_best=...): the replicas' states come back at the end of every
    # ``best_every``-th epoch (those whose record has the watched metric), and a window
    # ends there, so the loop can keep the best epoch's weights (None: not kept)
    best_every: int | None = None
    # scale_with_batch: before each later phase, the workers its batch wants are asked
    # of the cluster when the fit has fewer (None: the cluster is not scaled)
    scaling: WorkerScaling | None = None
    sync: SyncPolicy = field(default_factory=Synchronous)
    # the held-out samples an evaluation scores (the graph's Evaluate source), if any: a
    # window salvaged without a lost replica must still have scored all of them
    held_out_samples: int | None = None


class FitMachine(LostWorkers, WindowFailures, WindowPlanning, StopOnSignal):
    """One fit's decisions. See the module docstring; ``state`` is its typed state."""

    def __init__(self, config: MachineConfig, *, validate: bool | None = None) -> None:
        self.config = config
        self.state = FitState()
        self.log = DriverLog(config)  # loggable copies of (event, commands), bounded
        # check the state's invariants after every event (tests turn it on)
        self.validate = validate if validate is not None else _validating()

    def handle(self, event: ev.Event) -> list[cmd.Command]:
        """The commands ``event`` leads to, by the declared table
        (``dataflow.driver.transitions``); both go to the log (as plain copies)."""
        entry = rule(self.state, event)
        if isinstance(entry, Ignored):
            commands: list[cmd.Command] = []
        else:
            commands = getattr(self, entry)(event)
        fail = next((c for c in commands if isinstance(c, cmd.Fail)), None)
        if fail is not None:
            self.state.failing = fail
        if self.validate:
            validate_state(self.state, self.config)
        self.log.record(event, commands)
        return commands

    # -- membership -------------------------------------------------------------------
    @property
    def members(self) -> tuple[str, ...]:
        return self.state.layout.leaders

    def _joinable(self) -> tuple[str, ...]:
        s, config = self.state, self.config
        if not config.may_join:
            return ()
        joiners = tuple(w for w in s.available if w not in s.layout.worker_set)
        groups = len(joiners) // config.spatial  # a replica needs P workers
        if config.max_replicas is not None:
            groups = min(groups, max(0, config.max_replicas - s.layout.replicas))
        return joiners[: groups * config.spatial]

    def _groups(self, workers: tuple[str, ...]) -> ReplicaGroups:
        """Replicas of ``config.spatial`` workers each; the rest wait in the pool."""
        groups = ReplicaGroups.of(workers, self.config.spatial)
        spare = tuple(w for w in workers if w not in groups.worker_set)
        self.state.available = (*self.state.available, *spare)
        return groups

    def _form(
        self, layout: ReplicaGroups, *, joining: tuple[str, ...] = (), after: AfterGroup
    ) -> list[Any]:
        s = self.state
        s.generation += 1
        s.layout, s.joining, s.after_group, s.status = layout, joining, after, Status.FORMING
        s.available = tuple(w for w in s.available if w not in layout.worker_set)
        phase = s.next_phase if after == AfterGroup.PHASE else s.phase
        form = cmd.FormGroup(s.generation, layout.leaders, joining=joining, groups=layout.groups)
        return [dataclasses.replace(form, phase=getattr(phase, "index", None))]

    def _position(self) -> PhasePosition:
        """Where the running phase stands, for the checkpoint a command writes."""
        s = self.state
        return PhasePosition(s.phase_steps, s.segment, s.lr_factor, s.rollbacks, s.memory_cap)

    def _started(self, event: ev.Started) -> list[Any]:
        s = self.state
        s.layout, s.generation, s.status = self._groups(event.workers), 0, Status.FORMING
        s.available = (*s.available, *event.spares)  # pooled, as a restart pools its extras
        s.forming, s.after_group, s.restoring = Forming.START, AfterGroup.CHOOSE, event.restore
        s.memory_cap = event.memory_cap  # a resumed fit does not run out of memory again
        s.epoch, s.next_step, s.previous = event.epoch, event.step, event.previous
        s.resume_in_phase = event.in_phase
        return [
            cmd.FormGroup(
                0, self.members, fresh=True, restore=event.restore, groups=s.layout.groups
            )
        ]

    def _group_formed(self, event: ev.GroupFormed) -> list[Any]:
        s = self.state
        if event.generation != s.generation or s.status != Status.FORMING:
            return []
        after, s.forming, s.joining, s.group_retries = s.after_group, Forming.REGROUP, (), 0
        s.formed_replicas = s.layout.replicas
        if after == AfterGroup.END:
            s.status = Status.ENDING
            return [cmd.EndPhase(s.generation, self.members)]
        if after == AfterGroup.CHECKPOINT:
            s.status, s.after_group = Status.BOUNDARY, AfterGroup.CHOOSE
            return [self._phase_checkpoint(), *self._next_phase()]
        if after == AfterGroup.FINISH:  # lost before the fit's last checkpoint or weights: again
            s.status = Status.DONE
            again = [self._phase_checkpoint()] if self.config.checkpoints and s.phase else []
            return [*again, cmd.Finish(self.members)]
        s.restoring = False
        return self._plan(after)

    def _group_failed(self, event: ev.GroupFailed) -> list[Any]:
        """A rendezvous that failed: form the same group again under a new generation
        (members that joined the failed one refuse its late tasks), a few times; then
        the error stands. The user's own error stands at once."""
        s = self.state
        s.group_retries += 1
        if not event.rendezvous or s.group_retries > self.config.max_group_retries:
            s.status = Status.FAILED
            return [cmd.Fail(error=event.error)]
        s.generation += 1
        fresh = s.forming in (Forming.START, Forming.RESTART)
        return [
            cmd.FormGroup(
                s.generation,
                self.members,
                joining=s.joining,
                fresh=fresh,
                restore=s.restoring,
                groups=s.layout.groups,
            )
        ]

    def _plan(self, kind: AfterGroup) -> list[Any]:
        """Ask the planner: ``CHOOSE`` the next phase, ``PHASE`` the chosen phase's
        steps, ``REST`` the running phase's steps from the commit on."""
        s = self.state
        s.status, s.after_group = Status.PLANNING, kind
        cap = s.memory_cap
        if kind == AfterGroup.CHOOSE and s.resume_in_phase:  # the checkpoint's phase first
            s.resume_in_phase = False
            resumed = cmd.SegmentKind.RESUMED
            return [cmd.PlanSegment(resumed, s.layout.replicas, None, s.next_step, memory_cap=cap)]
        if kind == AfterGroup.CHOOSE:
            return self._next_phase()
        if kind == AfterGroup.PHASE:
            replicas = s.layout.replicas
            return [
                cmd.PlanSegment(
                    cmd.SegmentKind.PHASE, replicas, s.next_phase, s.next_step, memory_cap=cap
                )
            ]
        rest = cmd.PlanSegment(
            cmd.SegmentKind.REST, s.layout.replicas, s.phase, s.committed_step, memory_cap=cap
        )
        return [dataclasses.replace(rest, segment=s.segment, phase_steps=s.phase_steps)]

    def _workers_joined(self, event: ev.WorkersJoined) -> list[Any]:
        s = self.state
        known = {*s.available, *s.layout.worker_set}
        new = [w for w in event.workers if w not in known]
        s.available = (*s.available, *new)
        return []

    def _workers_recovered(self, event: ev.WorkersRecovered) -> list[Any]:
        """Workers excluded as silent or hung that are back and idle go back to the pool,
        taken at the next phase as joiners are (torchft readmits a replica that answers
        again): a node's transient stall (a file system, a network blip) does not cost it
        for the rest of the fit. Once only: a second hang excludes a worker for good."""
        s = self.state
        back = tuple(w for w in event.workers if w in s.readmittable)
        if not back:
            return []
        s.readmittable = tuple(w for w in s.readmittable if w not in back)
        s.readmitted = (*s.readmitted, *back)
        s.available = (*s.available, *back)
        return [cmd.ReadmitWorkers(back, s.epoch)]

    # -- phases -----------------------------------------------------------------------
    def _phase_chosen(self, event: ev.PhaseChosen) -> list[Any]:
        s = self.state
        if s.status not in (Status.PLANNING, Status.BOUNDARY):
            return []
        if event.phase is None or s.stop_asked is not None:  # (asked while it was chosen)
            s.status = Status.DONE
            return [cmd.Finish(self.members)]
        scaling = self.config.scaling
        if scaling is not None and s.previous is not None and s.scaled_for != event.phase.index:
            # more workers for a larger batch: decided once, before the phase is planned
            s.scaled_for = event.phase.index
            have = len(s.layout.worker_set) + len(s.available)
            more = more_workers(scaling, event.phase.global_batch, have)
            if more is not None:
                return [cmd.ScaleCluster(event.phase, more.requested, scaling.timeout_s, more)]
        s.next_phase = event.phase
        joiners = self._joinable()
        if joiners:
            layout = s.layout.plus(ReplicaGroups.of(joiners, self.config.spatial))
            return self._form(layout, joining=joiners, after=AfterGroup.PHASE)
        return self._plan(AfterGroup.PHASE)

    def _segment_planned(self, event: ev.SegmentPlanned) -> list[Any]:
        s = self.state
        if s.status != Status.PLANNING:
            return []
        new_phase = s.phase is None or event.phase.index != s.phase.index
        s.phase, s.phase_steps = event.phase, event.phase_steps
        s.segment = event.todo or s.segment  # nothing left: the phase record keeps its split
        if new_phase:
            s.lr_factor, s.rollbacks, s.memory_halvings, s.stalls = 1.0, 0, 0, 0
        if event.lr_factor is not None:  # a resumed phase's
            s.lr_factor = event.lr_factor
        if event.rollbacks is not None:
            s.rollbacks = event.rollbacks
        s.countdown = self.config.checkpoint_every or 0
        s.reviewing = None  # (a review a recovery overtook: its verdict is kept, not awaited)
        s.windows.clear()
        s.pending.clear()
        s.commit_window = s.next_window
        if not event.todo:
            s.status = Status.ENDING
            return [cmd.EndPhase(s.generation, self.members)]
        s.committed_step = s.planned_until = event.todo[0].index
        s.status = Status.RUNNING
        begin = cmd.BeginPhase(
            s.generation,
            self.members,
            event.phase,
            event.todo,
            event.continued,
            s.lr_factor,
            phase_length=len(s.phase_steps),
        )
        return [begin, self._submit_next()]

    def _window_done(self, event: ev.WindowDone) -> list[Any]:
        s = self.state
        if event.generation != s.generation or event.window not in s.windows:
            return []  # a window of a group or plan that a recovery replaced
        if event.window >= s.queued_until:
            return []  # never queued: no replica can have run it
        s.pending.setdefault(event.window, {}).update(event.results)
        if s.releasing:
            return self._window_done_releasing()
        out = self._commit_ready(lost=())
        if s.status != Status.RUNNING:
            return out
        if s.windows:
            return [*out, *self._queue_ahead()]
        if s.stop_signal is not None and s.planned_until <= s.segment[-1].index:
            return out  # held for a stop: nothing new starts (the phase's end may)
        s.step_seconds = _step_seconds(s.last_results)
        last = s.segment[s.planned_until - 1 - s.segment[0].index]
        more = s.planned_until < s.segment[-1].index + 1
        if self.config.epoch_review and more and last.last_in_epoch:
            s.reviewing = last.epoch  # the callbacks decide before the next epoch starts
            return out
        return [*out, *self._go_on()]

    def _go_on(self) -> list[Any]:
        """Every planned window committed: plan the segment's next steps, or end the phase."""
        s = self.state
        if s.planned_until < s.segment[-1].index + 1:
            cap = s.memory_cap
            if cap is not None and largest_planned(s.segment, s.planned_until) > cap:
                return self._plan(AfterGroup.REST)  # a measured cap: the rest under it
            return [self._submit_next()]
        s.status = Status.ENDING
        return [cmd.EndPhase(s.generation, self.members)]

    def _epoch_reviewed(self, event: ev.EpochReviewed) -> list[Any]:
        """The callbacks' verdict on an epoch: awaited (running, every window committed),
        the fit goes on, or, asked to stop, ends the phase at that epoch's end and the
        fit at that boundary. Not awaited (the phase's last epoch, or a recovery since),
        a stop ends the fit at the next epoch end it waits at, or the next boundary."""
        s = self.state
        if event.stop is not None and s.stop_asked is None:
            s.stop_asked = event.epoch
        if s.reviewing is None or event.epoch != s.reviewing or s.status != Status.RUNNING:
            return []  # (a loss while it was awaited: the recovery plans anew)
        s.reviewing = None
        if s.stop_asked is None:
            return self._go_on()
        done = s.committed_step  # the epoch's end: every step before it committed
        s.phase = dataclasses.replace(s.phase, end_epoch=event.epoch + 1)
        s.phase_steps = tuple(spec for spec in s.phase_steps if spec.index < done)
        s.segment = tuple(spec for spec in s.segment if spec.index < done)
        s.status = Status.ENDING
        return [cmd.EndPhase(s.generation, self.members)]

    def _commit_ready(self, lost: Iterable[int]) -> list[Any]:
        """Commit windows in order while the policy allows; with ``lost`` replicas, a
        window every other replica finished commits too (salvage)."""
        s, out = self.state, []
        lost = tuple(lost)
        replicas = s.layout.replicas
        while s.commit_window in s.windows:
            got = s.pending.get(s.commit_window, {})
            if not self.config.sync.may_commit(got, replicas) and not (
                lost
                and len(lost) < replicas
                and self._finished_but(got, lost)
                and (self._scored_whole_held_out(got) or self._survivors_went_past())
            ):
                break
            plan, window, marked = s.windows.pop(s.commit_window)
            s.pending.pop(s.commit_window, None)
            results = tuple(map(got.get, range(replicas)))
            out.append(cmd.CommitWindow(plan, window, results, s.segment))
            s.committed_step = plan.steps[window.stop - 1].index + 1
            s.commit_window += 1
            if not any(map(operator.is_, results, itertools.repeat(None))):  # (no __eq__ each)
                s.last_results = results
                measured = measured_cap(results)  # on CUDA, a phase's first window
                if measured is not None:
                    s.memory_cap = min(measured, s.memory_cap or measured)
            last = plan.steps[window.stop - 1]
            keeps_best = self._keeps_best(last)
            if not (marked or keeps_best):
                continue
            states = tuple(getattr(r, "checkpoint", None) for r in results)
            if not all(state is not None for state in states):
                continue  # a replica lost after the window: no whole state to take
            if marked:
                out.append(self._checkpoint_here(cmd.CheckpointKind.WINDOW, states=states))
            if keeps_best:
                out.append(cmd.KeepIfBest(last.epoch, s.committed_step, states))
        return out

    def _commit_refused(self, event: ev.CommitRefused) -> list[Any]:
        """The recorder found a committed window wrong: the fit stops with its error."""
        self.state.status = Status.FAILED
        return [cmd.Fail(error=event.error)]

    def _finished_but(self, got: dict[int, Any], lost: tuple[int, ...]) -> bool:
        """Whether every replica but the ``lost`` ones has its result in ``got``."""
        return all(r in got or r in lost for r in range(self.state.layout.replicas))

    def _phase_ended(self, event: ev.PhaseEnded) -> list[Any]:
        s = self.state
        if event.generation != s.generation or s.status != Status.ENDING:
            return []
        digests = {end.get("weights_digest") for end in event.ends}
        if len(digests) > 1:
            s.status = Status.FAILED
            return [cmd.Fail(error=_diverged(s.phase.index, digests))]
        s.status = Status.BOUNDARY
        out: list[Any] = [cmd.RecordPhase(s.phase, s.phase_steps, s.segment, tuple(event.ends))]
        s.previous, s.epoch = s.phase, s.phase.end_epoch
        s.next_step = s.phase_steps[0].index + len(s.phase_steps)
        if self.config.checkpoints:
            out.append(self._phase_checkpoint())
        # Still "boundary" until the phase is chosen: a loss meanwhile writes the
        # checkpoint again on the survivors.
        s.after_group = AfterGroup.CHOOSE
        return [*out, *self._next_phase()]

    def _next_phase(self) -> list[Any]:
        """The end of training (every epoch trained, or a callback asked to stop: the
        machine's own decision), or the schedule asked for the next phase."""
        s = self.state
        done = self.config.epochs is not None and s.epoch >= self.config.epochs
        if s.stop_signal is not None and not done:  # the phase's checkpoint is written
            return [self._stopped()]
        if done or s.stop_asked is not None:
            s.status = Status.DONE
            return [cmd.Finish(self.members)]
        return [cmd.ChoosePhase(s.epoch, s.previous)]

    def _phase_checkpoint(self) -> cmd.WriteCheckpoint:
        return self._checkpoint_here(cmd.CheckpointKind.PHASE, members=self.members)

    def _checkpoint_here(self, kind: cmd.CheckpointKind, **taken: Any) -> cmd.WriteCheckpoint:
        """A checkpoint of the commit, where the running phase stands; ``taken``: whose
        states (``members``) or the states themselves (``states``)."""
        s = self.state
        return cmd.WriteCheckpoint(
            kind, s.committed_step, s.phase, position=self._position(), **taken
        )

    def _phase_index(self) -> int | None:
        return None if self.state.phase is None else self.state.phase.index


def _step_seconds(results: tuple[Any, ...]) -> float | None:
    """The median over the last window's steps (the first left out when there are more)
    of the slowest replica's step time: what the next plan fuses windows by."""
    if not results:
        return None
    per_step = [max(values) for values in zip(*(r.step_seconds for r in results), strict=True)]
    tail = per_step[1:] if len(per_step) > 1 else per_step
    return statistics.median(tail) if tail else None


def _diverged(phase: int, digests: set[Any]) -> BaseException:
    return ReplicaError(
        f"replica weights diverged after phase {phase}: the replicas' parameters, buffers "
        f"or moving averages differ (digests {digests}); this is a bug in the engine or "
        "in a custom stage: please report it with this error's driver_log"
    )


def _validating() -> bool:
    """``DATAFLOW_VALIDATE_DRIVER=1`` (the test suite sets it): check the state after
    every event."""
    return os.environ.get("DATAFLOW_VALIDATE_DRIVER", "") not in ("", "0")


def replay(config: MachineConfig, events: Iterable[Any]) -> tuple[FitMachine, list[list[Any]]]:
    """A machine fed ``events`` again, and the commands each one gave: a fit's log in,
    the same decisions out (the state checked after each)."""
    machine = FitMachine(config, validate=True)
    return machine, [machine.handle(event) for event in events]
