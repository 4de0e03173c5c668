"""What happens to a fit, as typed events: the state machine's only input.

The executor turns Dask's futures and the scheduler's view of the workers into
these; the planner turns its answers into :class:`SegmentPlanned` and
:class:`PhaseChosen`. Each is plain data, so a recovery path is a list of events
in a test (``tests/test_driver_machine.py``) and a fit's log can be replayed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Started:
    """The fit begins on ``workers`` (one replica each, in rank order); ``restore``: the
    replicas load a checkpoint once their group is formed (``fit(resume=True)``);
    ``memory_cap``: the micro-batch cap the resumed fit had learned (None: none);
    ``spares``: the client's other workers (beyond ``replicas`` or ``max_workers``),
    pooled: they replace lost ones when the fit takes joins."""

    workers: tuple[str, ...]
    restore: bool = False
    memory_cap: int | None = None
    # where the fit starts (a resume: the checkpoint's): the first epoch and step to
    # train, and the phase before them (None: none, or the checkpoint is inside a phase)
    epoch: int = 0
    step: int = 0
    previous: Any = None
    in_phase: bool = False  # the checkpoint is inside a phase: its rest is trained first
    spares: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupFormed:
    """Every member of process group ``generation`` is set up (and restored) and waits."""

    generation: int


@dataclass(frozen=True)
class GroupFailed:
    """Forming group ``generation`` failed although no member was lost: ``error`` is what
    a member raised; ``rendezvous``: a failure of the rendezvous itself (a peer that
    restarted or stalled: worth forming the group again), not the user's own error (a
    model factory's, a source's: no retry mends it)."""

    generation: int
    error: BaseException
    rendezvous: bool = True


@dataclass(frozen=True)
class SetupFailed:
    """``workers`` raised their own error while setting up for group ``generation`` (not
    an echo of a peer's: e.g. a node without a library the model needs, or another
    version of a package the spec was pickled with) while the others did not: joiners
    whose members already run the fit, or some (not all) of a first group's workers.
    The node, not the fit, is at fault."""

    generation: int
    workers: tuple[str, ...]
    error: BaseException


@dataclass(frozen=True)
class PhaseChosen:
    """The schedule's next phase (``None``: the fit has trained every epoch)."""

    phase: Any  # dataflow.core PhaseSpec, or None


@dataclass(frozen=True)
class SegmentPlanned:
    """The steps to run now: a new phase's steps, the rest of a phase re-split after a
    recovery, or a resumed phase's rest. ``phase_steps``: the whole phase as planned."""

    phase: Any  # PhaseSpec
    phase_steps: tuple[Any, ...]  # StepSpec
    todo: tuple[Any, ...]  # StepSpec: the steps left, split over the current members
    continued: bool = False  # inside a phase already begun (stages keep phase settings)
    # A resumed phase's LR cut (on_non_finite="rollback") and rollbacks so far; None:
    # a new phase starts at 1.0 and 0, the rest of a running phase keeps its own.
    lr_factor: float | None = None
    rollbacks: int | None = None


@dataclass(frozen=True)
class WindowDone:
    """Replicas of group ``generation`` finished window ``window`` (a fit-wide number the
    machine gave it): ``results`` maps each such rank to its :class:`WindowResult`.
    The executor sends every result it has of one window at once, so a round of 1,024
    replicas costs the machine a few events, not 1,024."""

    generation: int
    window: int
    results: Mapping[int, Any]


@dataclass(frozen=True)
class WindowFailed:
    """A window failed for a reason other than a lost worker (the executor checked the
    workers first): window ``window`` failed first, with ``error`` raised on replica
    ``rank``; ``non_finite`` a NaN/inf caught before the update (every replica sees the
    same reduced gradient), ``out_of_memory`` torch's out-of-memory error (the replica's
    micro-batch did not fit its device). ``failures``: every failed window the executor
    saw while it gave the others time to fail too, among which the machine picks the
    root cause (``root_cause.acted_on``: a peer's "connection closed" is only an echo);
    empty, or none readable: ``rank`` and ``error`` are the failure it acts on.
    ``slow``: when a replica's wait for its peers timed out, the replicas whose windows
    were still running once the others had had the failure grace to fail too (the slow
    ones, as far as the driver can tell; empty when it cannot)."""

    generation: int
    rank: int
    window: int
    error: BaseException
    non_finite: bool = False
    out_of_memory: bool = False
    failures: tuple[WindowFailure, ...] = ()
    slow: tuple[int, ...] = ()


class WindowFailure(NamedTuple):
    """One failed window task of a :class:`WindowFailed`: replica ``rank``'s window
    ``window``, its ``error`` as the fit reports it (None: it could not be read any
    more), and what kind it is (as ``WindowFailed``'s flags)."""

    window: int
    rank: int
    error: BaseException | None
    non_finite: bool = False
    out_of_memory: bool = False


@dataclass(frozen=True)
class PhaseEnded:
    """Every replica ended the phase; ``ends`` are their end-of-phase statistics."""

    generation: int
    ends: tuple[Any, ...]


@dataclass(frozen=True)
class WorkersLost:
    """Workers the scheduler no longer has (dead, or restarted under a new address)."""

    workers: tuple[str, ...]


@dataclass(frozen=True)
class WorkersSilent:
    """Members that did not answer the driver's probe within ``waited_s`` seconds after
    a collective failed while the scheduler named no loss (a cut link or a hung node
    sends no reset, and the scheduler's verdict can take minutes). Whether that makes
    them lost is the machine's rule (``_workers_silent``)."""

    workers: tuple[str, ...]
    waited_s: float


@dataclass(frozen=True)
class WorkersJoined:
    """Workers of the client that are not in the fit and that it may take."""

    workers: tuple[str, ...]


@dataclass(frozen=True)
class WorkersRecovered:
    """Workers the fit excluded as silent or hung (not as failed) that the scheduler
    still lists and that now answer with no task running: a hang that ended, a link
    back up. Whether they may join again is the machine's rule (``_workers_recovered``)."""

    workers: tuple[str, ...]


@dataclass(frozen=True)
class RestartPoint:
    """Every replica was lost: the newest checkpoint's step (``None``: there is none: the
    fit starts again from step 0) and the workers there are now (none came back: empty)."""

    step: int | None
    workers: tuple[str, ...]
    epoch: int = 0  # the checkpoint's first epoch to train, and the phase before it
    previous: Any = None
    in_phase: bool = False  # the checkpoint is inside a phase: its rest is trained first


@dataclass(frozen=True)
class StopRequested:
    """The driver process got a stop signal (``signal``, by name): save what is
    committed and stop (``dataflow.driver.stopping``)."""

    signal: str


@dataclass(frozen=True)
class WindowsHeld:
    """After ``HoldWindows``: the replicas start no more windows, and every window
    that had finished was queued before this."""


@dataclass(frozen=True)
class CommitRefused:
    """The recorder refused a window the machine committed: ``error`` is why (a loss not
    finite where the policy skips nothing, a replica that read other samples than the
    plan gave it, a user's epoch callback that raised). The machine decides what
    follows (the fit stops)."""

    error: BaseException


@dataclass(frozen=True)
class EpochReviewed:
    """The user's epoch callbacks ran on ``epoch``'s record (``fit(on_epoch=...)``);
    ``stop``: the reason one raised ``StopTraining`` (None: train on). The machine waits
    for it before it plans past the epoch's end, so a stop ends the fit there."""

    epoch: int
    stop: str | None = None


@dataclass(frozen=True)
class Timer:
    """Nothing happened for a poll interval (the executor watched the workers)."""


Event = (
    Started
    | GroupFormed
    | GroupFailed
    | SetupFailed
    | PhaseChosen
    | SegmentPlanned
    | WindowDone
    | WindowFailed
    | PhaseEnded
    | WorkersLost
    | WorkersSilent
    | WorkersJoined
    | WorkersRecovered
    | RestartPoint
    | CommitRefused
    | EpochReviewed
    | StopRequested
    | WindowsHeld
    | Timer
)
