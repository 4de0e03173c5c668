"""The fit state machine's typed state (the driver half of a fit, apart from the
history, which the recorder keeps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from dataflow.core.window import WINDOWS_AHEAD
from dataflow.planning.layout import ReplicaGroups


class Status(StrEnum):
    """What the machine waits for (see :class:`FitState`)."""

    IDLE = "idle"
    FORMING = "forming"
    PLANNING = "planning"
    RUNNING = "running"
    ENDING = "ending"
    BOUNDARY = "boundary"
    RESTARTING = "restarting"
    DONE = "done"
    FAILED = "failed"


class AfterGroup(StrEnum):
    """What follows the group being formed (or what a loss interrupted)."""

    CHOOSE = "choose"  # ask the schedule for the next phase
    PHASE = "phase"  # plan the chosen phase
    REST = "rest"  # plan the running phase's rest from the commit
    END = "end"  # end the phase (every window was committed)
    CHECKPOINT = "checkpoint"  # write the phase's checkpoint again, then choose
    FINISH = "finish"  # take the final weights (lost after the last phase)


class Forming(StrEnum):
    """Why a group is being formed, which decides what a loss meanwhile means: the fit's
    first group, a restart from a checkpoint, or the survivors' (and joiners') regroup."""

    START = "start"
    RESTART = "restart"
    REGROUP = "regroup"


@dataclass(frozen=True)
class PhasePosition:
    """Where the running phase stands, as a checkpoint records it: the phase as planned,
    the steps running, the LR cut and rollbacks so far, and the micro-batch cap learned."""

    phase_steps: tuple[Any, ...] = ()
    segment: tuple[Any, ...] = ()
    lr_factor: float = 1.0
    rollbacks: int = 0
    memory_cap: int | None = None


@dataclass
class FitState:
    """Where a fit stands. ``status``: what the machine waits for (``forming``: a group,
    ``planning``: the planner, ``running``: windows, ``ending``: the phase's end,
    ``boundary``: the phase checkpoint and the next phase, ``restarting``: workers and
    a checkpoint after every replica was lost)."""

    status: Status = Status.IDLE
    layout: ReplicaGroups = field(default_factory=ReplicaGroups)  # the replicas, in rank order
    generation: int = 0  # of the process group; a task of an older one is stale
    available: tuple[str, ...] = ()  # workers of the client that may join
    joining: tuple[str, ...] = ()  # joiners of the group being formed
    forming: Forming = Forming.START  # what a loss while forming means
    restoring: bool = False  # the group being formed loads a checkpoint
    after_group: AfterGroup = AfterGroup.CHOOSE  # what follows the group being formed
    # the fit's position between phases: the first epoch and global step the next phase
    # starts at, and the last phase trained (None: none yet, or resumed inside a phase)
    epoch: int = 0
    next_step: int = 0
    previous: Any = None
    next_phase: Any = None  # chosen, not yet planned
    scaled_for: int | None = None  # the phase the cluster was last scaled for
    phase: Any = None  # PhaseSpec running
    phase_steps: tuple[Any, ...] = ()  # the phase as planned
    segment: tuple[Any, ...] = ()  # the steps running now (re-split after a recovery)
    planned_until: int = 0  # the first step of the segment not yet in a plan
    committed_step: int = 0  # the first step not committed
    step_seconds: float | None = None  # measured; None: the next plan calibrates
    next_window: int = 0  # the fit-wide number the next window gets
    commit_window: int = 0  # the next window to commit
    # the first planned window not yet queued on the replicas: at most WINDOWS_AHEAD
    # windows run or wait past the commit (a replica keeps that many commits)
    queued_until: int = 0
    windows: dict[int, tuple[Any, Any, bool]] = field(default_factory=dict)  # (plan, window, ckpt)
    pending: dict[int, dict[int, Any]] = field(default_factory=dict)  # window -> rank -> result
    last_results: tuple[Any, ...] = ()  # the last window committed with every result
    countdown: int = 0  # windows until the next mid-phase checkpoint
    # Local(max_drift=...): the period (samples) the next window is planned with, and
    # the window whose drift set it (each measurement adapts the period once)
    period_samples: int | None = None
    period_set_at: int = -1
    lr_factor: float = 1.0  # on_non_finite="rollback": the phase's LR cut so far
    rollbacks: int = 0  # ... in this phase
    # Out-of-memory errors: the micro-batch cap learned (kept for the fit's later
    # phases; None: none) and the halvings in this phase
    memory_cap: int | None = None
    memory_halvings: int = 0
    stalls: int = 0  # collectives timed out on a live peer, in this phase
    restarts: dict[int, int] = field(default_factory=dict)  # checkpoint step -> restarts
    # fit(on_epoch=...): the epoch whose callbacks' verdict the machine waits for before
    # it plans past the epoch (None: none awaited), and the epoch after which a callback
    # asked the fit to stop (None: not asked)
    reviewing: int | None = None
    stop_asked: int | None = None
    stop_signal: str | None = None  # a stop signal's name, once the driver got one
    group_retries: int = 0  # of the group being formed (no member lost, it failed anyway)
    # Workers' own setup errors so far ("Type: first line"): the same one on a second
    # worker is the fit's mistake, not a node's
    setup_errors: frozenset[str] = frozenset()
    # Workers excluded as silent or hung that may be taken again once back and idle, and
    # those taken again once already (a second hang excludes them for good)
    readmittable: tuple[str, ...] = ()
    readmitted: tuple[str, ...] = ()
    lost_everything: Any = None  # the FailureRecord of a restart (every replica lost)
    # Replicas of the last group formed (or started again): what a restart waits a
    # little for when every replica is lost, even if a regroup after a first loss had
    # shrunk the layout before the last one went (workers die one event at a time)
    formed_replicas: int = 0
    # Asynchronous updates: replicas lost while the survivors finish the window in
    # flight (fit-wide number ``release_window``) without them, and their workers
    releasing: tuple[int, ...] = ()
    released_workers: tuple[str, ...] = ()
    release_window: int = -1
    # The Fail the machine issued: a loss before the loop reached it (while the
    # survivors roll back or save their checkpoint) leads to it again, not to a recovery
    failing: Any = None
    # the fit starts (a resume, a restart) from a checkpoint inside a phase: the first
    # plan is that phase's rest, not the next phase
    resume_in_phase: bool = False


def validate_state(s: FitState, config: Any) -> None:
    """Raise ``AssertionError`` naming the first invariant of a fit's state that does not
    hold (run after every event when validating: the test suite does)."""
    problems = []
    if not 0 <= s.commit_window <= s.next_window:
        problems.append(f"commit_window {s.commit_window} outside [0, {s.next_window}]")
    outside = [w for w in s.windows if not s.commit_window <= w < s.next_window]
    if outside:
        problems.append(f"windows {outside} outside [{s.commit_window}, {s.next_window})")
    if s.windows and s.queued_until > s.commit_window + WINDOWS_AHEAD:
        problems.append(
            f"windows queued until {s.queued_until}, more than {WINDOWS_AHEAD} past the "
            f"commit window {s.commit_window} (a replica keeps {WINDOWS_AHEAD} commits)"
        )
    if s.releasing and not s.release_window < s.queued_until:
        problems.append(f"released window {s.release_window} never queued")
    unqueued = [w for w in s.pending if w >= s.queued_until]
    if unqueued:
        problems.append(f"results pending for windows {unqueued} never queued")
    unplanned = [w for w in s.pending if w not in s.windows]
    if unplanned:
        problems.append(f"results pending for windows {unplanned} the machine does not wait for")
    workers = s.layout.workers
    if len(set(workers)) != len(workers):
        problems.append(f"a worker in two replicas: {workers}")
    both = s.layout.worker_set.intersection(s.available)
    if both:
        problems.append(f"workers both members and available: {sorted(both)}")
    excluded = set(s.readmittable).intersection(s.available)
    if excluded:
        problems.append(f"excluded workers {sorted(excluded)} available")
    if not set(s.joining) <= s.layout.worker_set:
        problems.append(f"joining {s.joining} not in the layout")
    if any(len(group) != config.spatial for group in s.layout.groups):
        problems.append(f"a replica without {config.spatial} worker(s): {s.layout.groups}")
    if s.status == Status.RUNNING and (s.phase is None or not s.segment):
        problems.append("running with no phase or segment")
    if s.reviewing is not None and s.windows:
        problems.append(f"awaiting epoch {s.reviewing}'s review with windows in flight")
    if s.status == Status.RUNNING and not s.committed_step <= s.planned_until:
        problems.append(f"committed step {s.committed_step} past planned {s.planned_until}")
    if not 0.0 < s.lr_factor <= 1.0:
        problems.append(f"lr_factor {s.lr_factor} outside (0, 1]")
    if s.rollbacks > config.max_rollbacks:
        problems.append(f"{s.rollbacks} rollbacks past max_rollbacks={config.max_rollbacks}")
    if s.memory_halvings > config.max_memory_halvings:
        problems.append(f"{s.memory_halvings} memory halvings past the budget")
    if s.stalls > config.max_stalls:
        problems.append(f"{s.stalls} stalled collectives redone past the budget")
    if s.memory_cap is not None and s.memory_cap < 1:
        problems.append(f"micro-batch cap {s.memory_cap} < 1")
    if any(not 0 <= r < s.layout.replicas for r in s.releasing) and s.status == Status.RUNNING:
        problems.append(f"releasing ranks {s.releasing} outside the {s.layout.replicas} replicas")
    if problems:
        raise AssertionError(f"fit state invalid while {s.status.value}: {'; '.join(problems)}")
