"""A real fit's driver log replays: the events a fit's state machine handled, fed to a
fresh machine, give the very commands the live run gave. The log holds plain copies: a
replica's state as a marker, an error as its name and message, so what the recorder
changes afterwards does not change the log.

The real fit is test_lost_worker.py's
``test_sigkill_mid_window_recovers_on_survivors_and_keeps_every_sample_once``: 3
workers, a phase change, mid-phase checkpoints, a worker SIGKILLed mid-window and the
nanny's restart joining again. It calls :func:`assert_log_replays` on its result; one
fit serves both, so the suite starts no extra cluster for this.
"""

from __future__ import annotations

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.log import STATE_TAKEN, loggable
from dataflow.driver.machine import replay


def assert_log_replays(result, *, phases: set[int]) -> None:
    """``result``'s driver log saw a loss, a join, ``phases`` and checkpoints inside a
    phase, and replays to the commands the live run gave."""
    log = result.driver_log
    assert log.dropped == 0 and len(log) > 0
    events, commands = log.events, log.commands
    kinds = {type(e) for e in events}
    assert {ev.WorkersLost, ev.WorkersJoined, ev.WindowDone, ev.PhaseEnded} <= kinds
    chosen = {e.phase.index for e in events if isinstance(e, ev.PhaseChosen) and e.phase}
    assert chosen == phases
    inside = [c for c in commands if isinstance(c, cmd.WriteCheckpoint) and c.kind == "window"]
    assert inside and all(set(c.states) == {STATE_TAKEN} for c in inside)

    machine, replayed = replay(log.config, events)
    assert [loggable(c) for out in replayed for c in out] == commands
    assert machine.state.status == "done"
