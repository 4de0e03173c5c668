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

import os
import pickle
from pathlib import Path

import pytest

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.log import STATE_TAKEN, loggable
from dataflow.driver.machine import replay

# The log of that real fit, saved: its replay runs in the fast tier. Written by
#   DATAFLOW_WRITE_LOG_FIXTURE=1 python -m pytest tests/test_lost_worker.py -k sigkill_mid_window
# again whenever an event, command or result type changes shape (unpickling or the
# replay then fails here, naming this command).
FIXTURE = Path(__file__).parent / "fixtures" / "driver_log_lost_worker.pkl"


def assert_log_replays(result, *, phases: set[int]) -> None:
    """``result``'s driver log saw a loss, a join, ``phases`` and checkpoints inside a
    phase, and replays to the commands the live run gave."""
    log = result.driver_log
    if os.environ.get("DATAFLOW_WRITE_LOG_FIXTURE"):
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_bytes(pickle.dumps(log))
    check_log(log, phases)


def check_log(log, phases: set[int]) -> None:
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


def test_a_saved_real_fit_log_replays_to_its_commands():
    """The fast tier's replay: the saved log of a real fit that lost a worker mid-window
    (a loss, a join, three phases, mid-phase checkpoints) gives the same commands fed to
    a fresh machine, with the state's invariants checked after every event; every
    command the machine gave was carried out but where a loss stopped the list."""
    try:
        log = pickle.loads(FIXTURE.read_bytes())
    except Exception as error:  # a type changed shape since the fixture was written
        pytest.fail(f"{FIXTURE.name} does not load ({error!r}): write it again (see FIXTURE)")
    check_log(log, {0, 1, 2})
    assert not any(isinstance(e, ev.Timer) for e in log.events)  # a poll is not logged
    carried = [(entry.carried_out, len(entry.commands)) for entry in log.entries]
    assert all(done is not None and done <= given for done, given in carried)
    assert sum(done < given for done, given in carried) <= 1  # the command the kill stopped
