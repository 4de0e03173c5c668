"""Which event the fit machine takes in which status: one declared table.

``TRANSITIONS[status][event type]`` is the name of the ``FitMachine`` method that
decides, or :class:`Ignored` with the reason the event means nothing there; an event
in a status the table does not list raises :class:`InvalidTransition` (a bug in the
driver, never a silently dropped event). Before the table, two kinds of event are
*stale* by design and dropped (``stale``): a group's answer for an older process-group
generation (a recovery formed a new group since), and a window the machine no longer
waits for (rolled back, or committed). Pure: no Dask, torch or I/O. distributed's
``WorkerState`` validates its transitions the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dataflow.core.errors import DataflowError
from dataflow.driver import events as ev
from dataflow.driver.state import FitState, Status


class InvalidTransition(DataflowError, RuntimeError):
    """An event arrived in a status where the machine has no rule for it."""


@dataclass(frozen=True)
class Ignored:
    """The event means nothing in this status; ``why`` says why."""

    why: str


EVENT_TYPES: tuple[type, ...] = ev.Event.__args__  # type: ignore[attr-defined]

NOTHING_TO_DECIDE = Ignored("a poll interval passed: nothing to decide")
ASKED_BEFORE_A_LOSS = Ignored(
    "the planner's answer to a question asked before a loss; the machine asks again once "
    "the group is formed"
)
OVER = Ignored("the fit is over: nothing more to decide")

# Any status but the fit's end: membership changes, the poll, a refused commit.
MEMBERSHIP: Mapping[type, str | Ignored] = {
    ev.WorkersLost: "_workers_lost",
    # silent to the driver's probe: lost, then as WorkersLost in the status (the rule
    # looked up again for it)
    ev.WorkersSilent: "_workers_silent",
    ev.WorkersJoined: "_workers_joined",
    # excluded as silent or hung, back and idle: once, as joiners
    ev.WorkersRecovered: "_workers_recovered",
    ev.Timer: NOTHING_TO_DECIDE,
    # a window committed before the status moved on (a salvage, then a regroup)
    ev.CommitRefused: "_commit_refused",
    # the epoch callbacks' verdict, from the commit of the epoch's last window: awaited
    # while running; in any other status (a recovery since) a stop is kept for later
    ev.EpochReviewed: "_epoch_reviewed",
    # a stop signal: the commit saved (running), the phase's end first (ending), or the
    # newest checkpoint stands (between windows: it holds everything committed)
    ev.StopRequested: "_stop_requested",
    # the held replicas' finished windows are in: roll back to the commit and save it
    # (running), the phase's end first (ending), or stop now (a loss since: regrouping)
    ev.WindowsHeld: "_windows_held",
}

TRANSITIONS: Mapping[Status, Mapping[type, str | Ignored]] = {
    Status.IDLE: {ev.Started: "_started", **MEMBERSHIP},
    Status.FORMING: {
        ev.GroupFormed: "_group_formed",
        ev.GroupFailed: "_group_failed",
        ev.SetupFailed: "_setup_failed",
        ev.PhaseChosen: ASKED_BEFORE_A_LOSS,
        ev.SegmentPlanned: ASKED_BEFORE_A_LOSS,
        **MEMBERSHIP,
    },
    Status.PLANNING: {
        ev.PhaseChosen: "_phase_chosen",
        ev.SegmentPlanned: "_segment_planned",
        **MEMBERSHIP,
    },
    Status.RUNNING: {
        ev.WindowDone: "_window_done",
        ev.WindowFailed: "_window_failed",
        **MEMBERSHIP,
    },
    Status.ENDING: {ev.PhaseEnded: "_phase_ended", **MEMBERSHIP},
    # the phase is recorded; a phase chosen (or the cluster scaled for it) comes next
    Status.BOUNDARY: {ev.PhaseChosen: "_phase_chosen", **MEMBERSHIP},
    Status.RESTARTING: {
        ev.RestartPoint: "_restart_point",
        ev.PhaseChosen: ASKED_BEFORE_A_LOSS,
        ev.SegmentPlanned: ASKED_BEFORE_A_LOSS,
        **MEMBERSHIP,
    },
    # Done: a loss before the final weights are taken forms the survivors again
    Status.DONE: {t: OVER for t in EVENT_TYPES}
    | {ev.WorkersLost: "_workers_lost", ev.WorkersSilent: "_workers_silent"},
    # Failed: a loss before the loop reached the Fail (it stopped the command list while
    # the survivors rolled back or saved their checkpoint) leads to the Fail again
    Status.FAILED: {t: OVER for t in EVENT_TYPES}
    | {ev.WorkersLost: "_lost_while_failing", ev.WorkersSilent: "_workers_silent"},
}


def stale(state: FitState, event: ev.Event) -> bool:
    """Whether ``event`` answers for a group or a window the machine no longer has."""
    generation = getattr(event, "generation", None)
    if generation is not None and generation != state.generation:
        return True
    if isinstance(event, ev.WindowDone | ev.WindowFailed):
        return event.window not in state.windows
    return False


STALE = Ignored("it answers for a process group or a window the machine no longer has")


def rule(state: FitState, event: ev.Event) -> str | Ignored:
    """What ``event`` leads to in ``state``: the name of the deciding method, or
    :class:`Ignored` (a stale answer, or the table says so); ``InvalidTransition``
    where the table has no rule, ``TypeError`` for what is not an event."""
    if type(event) not in EVENT_TYPES:
        raise TypeError(
            f"FitMachine.handle: {type(event).__name__} is not an event "
            f"(dataflow.driver.events: {', '.join(t.__name__ for t in EVENT_TYPES)})"
        )
    if stale(state, event):
        return STALE
    entry = TRANSITIONS[state.status].get(type(event))
    if entry is None:
        raise InvalidTransition(
            f"the fit machine got {type(event).__name__} while {state.status.value}, which "
            "no rule allows: a bug in dataflow's driver; please report it with the fit's "
            "driver log (error.driver_log)"
        )
    return entry
