"""The machine's failure decisions that the executor only reports: which replica's
error is the root cause of a failed window round (the others' "connection closed" are
its echoes), and whether members silent to the driver's probe after a failed collective
are lost. Scripted events, no cluster: the real cut link is
tests/test_emulated_nodes.py's."""

from __future__ import annotations

import dataclasses

import pytest
from test_driver_machine import PHASE0, Driver, of, planned

from dataflow.core.errors import CollectiveError, NonFiniteError
from dataflow.core.phase import PhaseSpec
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.log import ErrorInfo, loggable
from dataflow.driver.machine import replay
from dataflow.errors import ReplicaError
from dataflow.ps.shard import ShardError

ECHO = CollectiveError("replica 0: connection closed by peer")
REAL = ReplicaError("replica 1 on worker tcp://b failed: ValueError: label 7 of 3 classes")
OOM = MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # the flag decides


def failed(d: Driver, *failures: ev.WindowFailure) -> list:
    """Window round ``failures`` as the executor reports it: the first seen (rank 0's
    echo) as the event's own failure, every one it collected in ``failures``."""
    first = failures[0]
    event = ev.WindowFailed(
        d.state.generation, first.rank, first.window, first.error, failures=failures
    )
    return d.send(event)


def test_the_machine_acts_on_the_real_failure_not_the_echo_that_came_first():
    d = Driver()
    _, submit = d.start()
    w = submit.first_window
    [fail] = failed(d, ev.WindowFailure(w, 0, ECHO), ev.WindowFailure(w, 1, REAL))
    assert isinstance(fail, cmd.Fail) and fail.error is REAL
    # only echoes: the earliest (window, rank); none readable: the event's own
    d = Driver()
    _, submit = d.start()
    w = submit.first_window
    later = CollectiveError("replica 1: connection closed by peer")
    [fail] = failed(d, ev.WindowFailure(w, 1, later), ev.WindowFailure(w, 0, ECHO))
    assert fail.error is ECHO
    d = Driver()
    _, submit = d.start()
    unread = (ev.WindowFailure(submit.first_window, 0, None),)
    [fail] = d.send(ev.WindowFailed(0, 1, submit.first_window, REAL, failures=unread))
    assert fail.error is REAL


def test_a_root_cause_out_of_memory_halves_the_cap_for_its_own_rank():
    """Rank 0's echo came first, rank 1 ran out of memory: the machine's decision follows
    the root cause's kind (a halved cap, the group formed again), for rank 1."""
    d = Driver()
    _, submit = d.start()
    w = submit.first_window
    out = failed(d, ev.WindowFailure(w, 0, ECHO), ev.WindowFailure(w, 1, OOM, False, True))
    assert [type(c) for c in out] == [
        cmd.RecordFailure,
        cmd.StopWindows,
        cmd.RollBack,
        cmd.FormGroup,
    ]
    assert out[0].record["reason"] == "out-of-memory" and out[0].record["rank"] == 1


def test_a_root_cause_non_finite_step_rolls_back_in_place():
    """A parameter-store call failed with a peer's reason first (a ShardError: an echo);
    the peer's NaN is the cause, and a NaN rolls back in place with a lower LR."""
    d = Driver(roll_back_non_finite=True)
    _, submit = d.start()
    w = submit.first_window
    store_echo = ShardError("parameter store, replica 0: replica 1 failed in window 0")
    nan = NonFiniteError("replica 1: non-finite gradient at step 0")
    out = failed(d, ev.WindowFailure(w, 0, store_echo), ev.WindowFailure(w, 1, nan, True))
    assert [type(c) for c in out[:3]] == [cmd.RecordFailure, cmd.StopWindows, cmd.RollBack]
    assert not of(cmd.StopWindows, out)[0].leave_group and d.state.lr_factor == 0.5


def test_the_replica_whose_batch_held_the_nan_is_the_root_cause_of_a_non_finite_step():
    """Every replica stops at the non-finite step (the reduced gradient is NaN on all);
    only the one whose own batch held the NaN can name the samples, so its error is the
    one reported, live or replayed from the log."""
    from dataflow.driver.root_cause import root_cause

    plain = NonFiniteError("non-finite loss or gradient at step 3 on replica 0")
    named = NonFiniteError(
        "non-finite loss or gradient at step 3 on replica 1. Found: the step's data holds "
        "NaN or inf (x as read) in sample(s) 37 of the source"
    )
    later = NonFiniteError("non-finite ... Found: the step's data holds NaN or inf in 9")
    failures = [((2, 0), plain), ((2, 1), named), ((3, 0), later)]
    assert root_cause(failures) == 1
    assert root_cause([(k, ErrorInfo.of(e)) for k, e in failures]) == 1
    assert root_cause([((2, 0), plain), ((3, 1), later)]) == 0  # the earliest window first
    assert root_cause([((2, 0), ECHO), ((2, 1), plain)]) == 1  # (echoes still go last)


def test_a_logged_window_failure_replays_to_the_same_root_cause():
    """The log holds each failure's error as text with the names of its classes, so the
    replayed machine tells the echo from the real error as the live one did."""
    d = Driver()
    _, submit = d.start()
    w = submit.first_window
    failed(d, ev.WindowFailure(w, 0, ECHO), ev.WindowFailure(w, 1, REAL))
    logged = d.machine.log.events[-1]
    assert [f.error for f in logged.failures] == [ErrorInfo.of(ECHO), ErrorInfo.of(REAL)]
    assert "CollectiveError" in logged.failures[0].error.kinds
    _, replayed = replay(d.machine.config, d.machine.log.events)
    assert [loggable(c) for out in replayed for c in out] == d.machine.log.commands
    assert replayed[-1][0].error == ErrorInfo.of(REAL)


def running(**config) -> Driver:
    """A machine mid-phase on W[:2], a window in flight."""
    d = Driver(**config)
    d.start()
    return d


def at_start(**config) -> Driver:
    d = Driver(**config)
    d.send(ev.Started(("tcp://a", "tcp://b", "tcp://c")))
    return d


def done(**config) -> Driver:
    d = Driver(**config)
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.finish_plan(train)
    d.send(ev.PhaseEnded(0, ({"weights_digest": "x"},) * 2))
    d.send(ev.PhaseChosen(None))
    assert d.state.status == "done"
    return d


def too_few(**config) -> Driver:
    """Failed: below min_workers, the Fail not yet carried out."""
    d = Driver(min_workers=2, **config)
    d.start()
    d.send(ev.WorkersLost(("tcp://a",)))
    assert d.state.status == "failed"
    return d


@pytest.mark.parametrize("where", [running, at_start, done, too_few])
def test_members_silent_to_the_probe_are_lost_and_excluded(where):
    """A member silent for the probe's time after a failed collective is lost: the
    executor is told to treat it as gone, and the rest is what the scheduler's word of
    the loss gives in that status (a twin machine fed WorkersLost)."""
    silent, twin = where(checkpoints=True), where(checkpoints=True)
    out = silent.send(ev.WorkersSilent(("tcp://b",), 5.0))
    assert out[0] == cmd.ExcludeWorkers(("tcp://b",))  # not for good: it may come back
    assert out[1:] == twin.send(ev.WorkersLost(("tcp://b",)))
    assert silent.state.readmittable == ("tcp://b",)
    assert dataclasses.replace(silent.state, readmittable=()) == twin.state


def silent_b_then_phase_1() -> tuple[Driver, list]:
    """b silent mid-phase 0: excluded, a trains the phase's rest alone; at phase 1's
    choice b is back and idle (the executor's WorkersRecovered, before PhaseChosen)."""
    d = Driver()
    _, calibration = d.start()
    of(cmd.SubmitWindows, d.finish_plan(calibration))
    [form] = of(cmd.FormGroup, d.send(ev.WorkersSilent(("tcp://b",), 5.0)))
    [rest] = d.send(ev.GroupFormed(form.generation))
    steps = planned(PHASE0, 1)
    [submit] = of(
        cmd.SubmitWindows, d.send(ev.SegmentPlanned(PHASE0, steps[rest.commit_step :], steps))
    )
    d.finish_plan(submit)
    d.send(ev.PhaseEnded(form.generation, ({"weights_digest": "x"},)))
    # c was never excluded: the executor would not report it; the machine ignores it
    back = d.send(ev.WorkersRecovered(("tcp://b", "tcp://c")))
    return d, back


PHASE1 = PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=16)


def test_a_member_excluded_as_silent_that_is_back_and_idle_joins_the_next_phase():
    """A hang that ended (or a link back up) no longer costs the worker for the rest of
    the fit: back in the pool, it joins at the next phase as a joiner does."""
    d, back = silent_b_then_phase_1()
    assert back == [cmd.ReadmitWorkers(("tcp://b",), epoch=2)]
    assert d.state.available == ("tcp://b",) and d.state.readmittable == ()
    [form] = d.send(ev.PhaseChosen(PHASE1))
    assert form.members == ("tcp://a", "tcp://b") and form.joining == ("tcp://b",)
    assert d.send(ev.WorkersRecovered(("tcp://b",))) == []  # once back, not again


def test_a_worker_readmitted_once_and_silent_again_is_excluded_for_good():
    d, _ = silent_b_then_phase_1()
    [form] = d.send(ev.PhaseChosen(PHASE1))
    d.send(ev.GroupFormed(form.generation))
    out = d.send(ev.WorkersSilent(("tcp://b",), 5.0))
    assert out[0] == cmd.ExcludeWorkers(("tcp://b",), for_good=True)
    assert d.state.readmittable == () and d.state.readmitted == ("tcp://b",)
    assert d.send(ev.WorkersRecovered(("tcp://b",))) == []
    assert "tcp://b" not in d.state.available


def test_a_worker_whose_setup_failed_is_never_readmitted():
    d = Driver()
    d.send(ev.Started(("tcp://a", "tcp://b", "tcp://c")))
    out = d.send(ev.SetupFailed(0, ("tcp://c",), ModuleNotFoundError("No module named 'x'")))
    assert out[0] == cmd.ExcludeWorkers(("tcp://c",), for_good=True)
    assert d.send(ev.WorkersRecovered(("tcp://c",))) == []
    assert "tcp://c" not in d.state.available


def test_a_readmission_is_logged_and_replays():
    d, _ = silent_b_then_phase_1()
    d.send(ev.PhaseChosen(PHASE1))
    assert ev.WorkersRecovered(("tcp://b", "tcp://c")) in d.machine.log.events
    _, replayed = replay(d.machine.config, d.machine.log.events)
    assert [loggable(c) for out in replayed for c in out] == d.machine.log.commands


def test_a_silent_member_is_logged_and_replays():
    d = running(checkpoints=True)
    d.send(ev.WorkersSilent(("tcp://b",), 5.0))
    assert d.machine.log.events[-1] == ev.WorkersSilent(("tcp://b",), 5.0)
    assert cmd.ExcludeWorkers(("tcp://b",)) in d.machine.log.commands
    _, replayed = replay(d.machine.config, d.machine.log.events)
    assert [loggable(c) for out in replayed for c in out] == d.machine.log.commands
    again = d.send(ev.GroupFormed(1))  # the survivor's group: the phase's rest is planned
    assert [type(c) for c in again] == [cmd.PlanSegment] and again[0].replicas == 1


def test_each_recorded_failure_has_its_console_line():
    """What a fit prints as it goes on (``progress=True``), from the record alone: a
    stall names the replicas still in their step when the driver could tell; a slow
    replica dropped names it, its workers and how many replicas go on."""
    from dataflow.driver.failure_lines import failure_line
    from dataflow.history.records import FailureRecord

    def record(reason, **extra):
        return FailureRecord(reason=reason, phase=0, commit_step=8, **extra)

    stalled = failure_line(record("stalled", rank=0, slow_replicas=[1]))
    assert "replica(s) [1] still in their step" in stalled and "from step 8" in stalled
    assert "still in their step" not in failure_line(record("stalled", rank=0, slow_replicas=[]))
    dropped = failure_line(
        record("slow replica dropped", lost=["tcp://b"], slow_replicas=[1], replicas_after=2)
    )
    assert dropped == (
        "dataflow: replica(s) [1] stalled the phase past max_stalls; going on without "
        "worker(s) tcp://b from step 8 on 2 replica(s)"
    )
    lost = failure_line(record("lost workers", lost=["tcp://c"], replicas_after=1))
    assert lost == "dataflow: lost worker(s) tcp://c; rolling back to step 8 on 1 replica(s)"
    assert failure_line(record("lost workers", lost=["tcp://c"], kept_window=False)) is None
    assert failure_line(record("a worker failed to set up")) is None
