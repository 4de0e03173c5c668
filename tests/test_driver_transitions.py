"""The fit machine's declared transitions: each (status, event) pair has a rule, an
event the table has no rule for raises, and the state's invariants are checked after
every event (the suite runs with ``DATAFLOW_VALIDATE_DRIVER=1``)."""

from __future__ import annotations

import pytest

from dataflow.driver import events as ev
from dataflow.driver.machine import FitMachine, MachineConfig
from dataflow.driver.state import Status
from dataflow.driver.transitions import EVENT_TYPES, TRANSITIONS, Ignored, InvalidTransition


def test_every_rule_names_a_method_of_the_machine_and_every_status_has_a_table():
    assert set(TRANSITIONS) == set(Status)
    for status, rules in TRANSITIONS.items():
        assert set(rules) <= set(EVENT_TYPES), status
        for entry in rules.values():
            assert isinstance(entry, Ignored) or callable(getattr(FitMachine, entry)), entry
        # a membership change or a poll is never a bug, whatever the status
        assert {ev.WorkersLost, ev.WorkersJoined, ev.Timer} <= set(rules), status


def test_an_event_with_no_rule_in_the_status_raises_naming_both():
    machine = FitMachine(MachineConfig())
    assert machine.state.status == Status.IDLE
    with pytest.raises(InvalidTransition, match=r"PhaseEnded while idle, which no rule allows"):
        machine.handle(ev.PhaseEnded(0, ()))  # generation 0 is the current one: not stale


def test_what_is_not_an_event_is_a_type_error():
    with pytest.raises(TypeError, match=r"dict is not an event"):
        FitMachine(MachineConfig()).handle({"window": 0})


def test_stale_answers_are_ignored_and_logged():
    machine = FitMachine(MachineConfig())
    machine.handle(ev.Started(("tcp://a", "tcp://b")))
    assert machine.handle(ev.GroupFormed(7)) == []  # another generation's
    assert machine.handle(ev.WindowDone(0, 3, {})) == []  # a window it does not wait for
    assert [type(e) for e in machine.log.events] == [ev.Started, ev.GroupFormed, ev.WindowDone]


def test_validation_names_a_broken_invariant():
    machine = FitMachine(MachineConfig(), validate=True)
    machine.handle(ev.Started(("tcp://a", "tcp://b")))
    machine.state.available = ("tcp://a",)  # a member cannot also wait in the pool
    with pytest.raises(AssertionError, match=r"both members and available: \['tcp://a'\]"):
        machine.handle(ev.WorkersJoined(()))
