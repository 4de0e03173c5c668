"""What the fit state machine asks for, as typed commands: its only output.

The executor carries out the ones that talk to the cluster (form a group, begin a
phase, submit windows, stop, roll back, end the phase, gather checkpoint states,
finish); the driver-side effects (record a window or a phase, plan, write a
checkpoint) run on the driver. Every command that addresses replicas carries the
members it addresses, so a test can check each goes to a live member.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from dataflow.driver.fit_settings import WorkersWanted
from dataflow.driver.state import PhasePosition


class SegmentKind(StrEnum):
    """Which steps ``PlanSegment`` asks for."""

    PHASE = "phase"  # a new phase, from its first step
    REST = "rest"  # the running phase's steps from the commit, re-split after a recovery
    # a fit started from a checkpoint inside a phase (a resume, a restart): that phase's
    # steps from the checkpoint's step (the loop holds the checkpoint's progress)
    RESUMED = "resumed"


class CheckpointKind(StrEnum):
    """Where a ``WriteCheckpoint`` is taken."""

    WINDOW = "window"  # inside a phase, from the states returned with a window
    PHASE = "phase"  # at a phase's end, from the members' states
    SURVIVORS = "survivors"  # the survivors' commit, before the fit gives up


@dataclass(frozen=True)
class FormGroup:
    """A process group ``generation`` over ``members`` (rank = position). ``fresh``:
    every member builds its replica anew (the fit's start, a restart), loading the
    checkpoint with ``restore``; otherwise members that already hold a replica keep
    its state and join under their new rank, and ``joining`` ones start from rank 0's
    weights and optimizer state."""

    generation: int
    members: tuple[str, ...]
    joining: tuple[str, ...] = ()
    fresh: bool = False
    restore: bool = False
    # Each replica's workers, leader first (spatial layouts); () = one worker each.
    groups: tuple[tuple[str, ...], ...] = ()
    phase: int | None = None  # the phase the group trains next (a regroup's record)


@dataclass(frozen=True)
class ChoosePhase:
    """Ask the schedule for the phase that starts at ``epoch``, after ``previous`` (None:
    the fit's first, or the first after a resume from inside a phase) with the
    measurement the recorder took of it (and, with ``scale_with_batch``, the cluster for
    the workers it needs). The machine asks only while epochs are left."""

    epoch: int = 0
    previous: Any = None  # PhaseSpec


@dataclass(frozen=True)
class ScaleCluster:
    """``scale_with_batch``: the fit has fewer workers than ``phase``'s batch wants: ask
    the cluster for ``wanted`` workers, wait up to ``timeout_s`` for them, record the
    request (``why``: who chose the count, and the cost model's predictions), then say
    ``PhaseChosen(phase)`` again, the workers that came first."""

    phase: Any  # PhaseSpec
    wanted: int
    timeout_s: float
    why: WorkersWanted


@dataclass(frozen=True)
class PlanSegment:
    """Ask the planner for the steps to run on ``replicas``: ``kind`` is ``PHASE``
    (``phase`` from its first step), ``REST`` (the phase's steps from ``commit_step``
    re-split after a recovery) or ``RESUMED`` (the checkpoint's phase from its step).
    ``memory_cap``: the micro-batch cap out-of-memory errors taught the fit (None:
    none), below the user's ``max_micro_batch``."""

    kind: SegmentKind
    replicas: int
    phase: Any = None
    commit_step: int = 0  # "rest": the first step not committed; "phase": its first step
    memory_cap: int | None = None
    # REST: the steps running and the phase as planned, to re-split (StepSpecs)
    segment: tuple[Any, ...] = ()
    phase_steps: tuple[Any, ...] = ()


@dataclass(frozen=True)
class BeginPhase:
    """Every member sets up ``steps`` of ``phase`` (LR, ramps, the epoch streams)."""

    generation: int
    members: tuple[str, ...]
    phase: Any
    steps: tuple[Any, ...]
    continued: bool
    lr_factor: float
    phase_length: int = 0  # the phase's steps as planned (its noise-measure cadence)


@dataclass(frozen=True)
class SubmitWindows:
    """Queue ``plan``'s windows ``queued`` (plan windows ``[start, stop)``; None: all)
    on every member, each behind the member's last task; plan window ``i`` is fit
    window ``first_window + i``; after the plan windows in ``checkpoints`` each replica
    returns its state for a mid-phase checkpoint, and after those in ``weights``
    (``keep_best``) its weights and buffers only."""

    generation: int
    members: tuple[str, ...]
    plan: Any  # dataflow.planning.plan.Plan
    first_window: int
    checkpoints: frozenset[int] = frozenset()
    weights: frozenset[int] = frozenset()
    queued: tuple[int, int] | None = None

    def queued_windows(self) -> list[Any]:
        """The plan's windows this command queues, in order."""
        start, stop = self.queued or (0, len(self.plan.windows))
        return list(self.plan.windows[start:stop])


@dataclass(frozen=True)
class CommitWindow:
    """Window ``window`` of ``plan`` is committed: record its steps. ``results`` has
    one WindowResult per replica, or None for a replica lost after it finished the
    window (its allreduce partners could not have finished without it): its samples
    follow from the plan."""

    plan: Any
    window: Any  # dataflow.planning.plan.Window
    results: tuple[Any, ...]
    segment: tuple[Any, ...] = ()  # the steps running: what each replica's reads follow from


@dataclass(frozen=True)
class WriteCheckpoint:
    """``WINDOW``: inside the phase at ``step``, from ``states`` (each replica's state
    returned with the window); ``PHASE``: at the end of ``phase`` (the executor asks
    ``members`` for their states); ``SURVIVORS``: the survivors' commit before the
    fit gives up on too few workers."""

    kind: CheckpointKind
    step: int
    phase: Any
    members: tuple[str, ...] = ()
    states: tuple[Any, ...] | None = None
    position: PhasePosition | None = None  # where the phase stands (its checkpoint's)


@dataclass(frozen=True)
class KeepIfBest:
    """Epoch ``epoch`` ended at ``step`` (its last window committed): ``states`` are
    each replica's state there (as a mid-phase checkpoint's); keep its weights if its
    record's watched metric is the best so far (``fit(keep_best=...)``)."""

    epoch: int
    step: int
    states: tuple[Any, ...]


@dataclass(frozen=True)
class HoldWindows:
    """A stop signal: ``members`` start no more windows (the running ones go on); the
    executor then queues every finished window's result and ``WindowsHeld``."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class StopWindows:
    """Stop what runs and drop what is queued on ``members`` (their group lost a peer,
    or a window failed): leave the broken group, wait for running windows to end."""

    members: tuple[str, ...]
    leave_group: bool = True
    groups: tuple[tuple[str, ...], ...] = ()  # as RollBack's


@dataclass(frozen=True)
class ExcludeWorkers:
    """Treat ``workers`` as gone from now on, whatever the scheduler says (members that
    stayed silent to the driver's probe after a failed collective): none of them is
    taken again as a member, a joiner or a restart's worker, nor sent the fit's clean-up.
    ``for_good``: never asked after again (a setup error, or a second hang); else the
    executor reports them if they come back idle (``WorkersRecovered``)."""

    workers: tuple[str, ...]
    for_good: bool = False


@dataclass(frozen=True)
class ReadmitWorkers:
    """Workers excluded as silent or hung are back, idle: they may be taken again, as
    joiners are (at the next phase, or as a spare), from ``epoch`` on."""

    workers: tuple[str, ...]
    epoch: int


@dataclass(frozen=True)
class ReleaseReplicas:
    """Asynchronous updates: replicas ``lost`` (ranks; workers ``workers``) are gone,
    and none hosted the parameter store. ``members`` (the survivors) finish the window
    in flight (fit-wide number ``window``, ending before ``stop_step``) without them,
    training again what the lost ones had not pushed, and run no later window."""

    generation: int
    members: tuple[str, ...]
    lost: tuple[int, ...]
    workers: tuple[str, ...]
    window: int
    stop_step: int


@dataclass(frozen=True)
class RollBack:
    """``members`` (in their new rank order) return to the state before ``step``."""

    members: tuple[str, ...]
    step: int
    leave_group: bool = True
    # The members' workers, by group; () = the groups they were formed in. A spatial
    # layout's partners of a lost worker roll back alone: ``((w,), ...)``.
    groups: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class EndPhase:
    """Every member ends the phase and reports its statistics."""

    generation: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class RecordPhase:
    """Fold the phase's statistics into the history (after every window committed)."""

    phase: Any
    phase_steps: tuple[Any, ...]  # the phase as planned: the epochs it must complete
    segment: tuple[Any, ...]  # the steps run last (their split is the phase's last)
    ends: tuple[Any, ...]


@dataclass(frozen=True)
class RecordFailure:
    """One entry of ``history.info["failures"]``: what was lost and what it cost.
    ``update``: new values for the open entry (a release, then what it came to)."""

    record: Any  # dataflow.history.records.FailureRecord
    update: bool = False


@dataclass(frozen=True)
class AwaitRestart:
    """Every replica is lost: wait up to ``wait_s`` for ``at_least`` workers, then up to
    ``gather_s`` more for ``gather`` (a nanny's restarts arrive one by one), then find the
    newest checkpoint; the workers there are reported (the machine picks the fit's)."""

    at_least: int
    gather: int
    wait_s: float
    gather_s: float


@dataclass(frozen=True)
class Restart:
    """The driver's state back to the checkpoint of ``step`` (history, ledger, noise);
    ``from_start``: there is none, back to the fit's start (step 0, nothing recorded)."""

    step: int
    from_start: bool = False


@dataclass(frozen=True)
class Fail:
    """Stop the fit. ``error``: a replica's failure to raise as it is; otherwise a
    ``WorkerLostError`` about ``lost`` (``remain`` left, ``restarts`` from one
    checkpoint used up if not None) naming where the work done so far is kept, and,
    in a spatial layout, the layout the ``workers_left`` could run; ``not_recovering``:
    the fit was told not to recover (``recover_lost_workers=False``); ``stopped_by``: a
    stop signal ended it (``FitStopped``), after the commit was saved; ``waited_s``:
    every replica was lost and no worker came back in that long (``restart_wait_s``)."""

    error: BaseException | None = None
    lost: tuple[str, ...] = ()
    remain: int = 0
    phase: int | None = None
    commit_step: int = 0
    starting: bool = False
    restarts_from: int | None = None
    workers_left: int | None = None  # live workers the fit could still use (spatial)
    not_recovering: bool = False
    stopped_by: str | None = None  # a stop signal's name: no failure, the fit was told to
    waited_s: float | None = None  # every replica lost: none came back in this long


@dataclass(frozen=True)
class Finish:
    """Every epoch is trained: take the final weights from ``members[0]``."""

    members: tuple[str, ...]


Command = (
    FormGroup
    | ChoosePhase
    | ScaleCluster
    | PlanSegment
    | BeginPhase
    | SubmitWindows
    | CommitWindow
    | WriteCheckpoint
    | KeepIfBest
    | HoldWindows
    | StopWindows
    | ExcludeWorkers
    | ReadmitWorkers
    | ReleaseReplicas
    | RollBack
    | EndPhase
    | RecordPhase
    | RecordFailure
    | AwaitRestart
    | Restart
    | Fail
    | Finish
)
