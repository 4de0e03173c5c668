"""The fit state machine's typed state (the driver half of a fit, apart from the
history, which the recorder keeps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

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


class Forming(StrEnum):
    """Why a group is being formed, which decides what a loss meanwhile means: the fit's
    first group, a restart from a checkpoint, or the survivors' (and joiners') regroup."""

    START = "start"
    RESTART = "restart"
    REGROUP = "regroup"


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
    after_group: str = "choose"  # what follows the group (or what a loss interrupted)
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
    restarts: dict[int, int] = field(default_factory=dict)  # checkpoint step -> restarts
    group_retries: int = 0  # of the group being formed (no member lost, it failed anyway)
    lost_everything: Any = None  # the FailureRecord of a restart (every replica lost)
    # Asynchronous updates: replicas lost while the survivors finish the window in
    # flight (fit-wide number ``release_window``) without them, and their workers
    releasing: tuple[int, ...] = ()
    released_workers: tuple[str, ...] = ()
    release_window: int = -1
