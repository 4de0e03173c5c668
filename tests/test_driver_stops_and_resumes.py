"""Two decisions the loop used to make itself, now the fit machine's (issue 38):

- a loss that interrupts the commands before the machine's ``Fail`` (while the
  survivors roll back or save their checkpoint) leads the machine to that ``Fail``
  again, naming the new loss; the loop no longer runs a ``Fail`` it skipped;
- a fit that starts from a checkpoint inside a phase (a resume, a restart) plans that
  phase's rest (``PlanSegment(RESUMED)``) instead of asking for the next phase.

Pure: events in, commands out, in milliseconds.
"""

from __future__ import annotations

import ast
import inspect

from test_driver_machine import PHASE0, Driver, W, of, planned

from dataflow.driver import commands as cmd
from dataflow.driver import events as ev


def _too_few_left() -> tuple[Driver, list]:
    d = Driver(min_workers=2, checkpoints=True)
    _, calibration = d.start()
    d.finish_plan(calibration)
    return d, d.send(ev.WorkersLost(("tcp://b",)))


def test_a_survivor_lost_before_the_fail_leads_to_the_fail_again_naming_it():
    d, out = _too_few_left()
    save, fail = out[-2], out[-1]
    assert save.kind == cmd.CheckpointKind.SURVIVORS and isinstance(fail, cmd.Fail)
    # the survivor dies while its checkpoint is gathered: the loop stops the list there
    [again] = d.send(ev.WorkersLost(("tcp://a",)))
    assert isinstance(again, cmd.Fail)
    assert again.lost == ("tcp://b", "tcp://a")
    assert (again.remain, again.commit_step, again.phase) == (1, 2, fail.phase)
    # the same worker reported again names it once; other events decide nothing
    assert d.send(ev.WorkersLost(("tcp://a",))) == [again]
    assert d.send(ev.Timer()) == [] and d.send(ev.WorkersJoined(("tcp://c",))) == []


def test_a_loss_after_the_users_own_error_raises_that_error():
    d = Driver()
    d.send(ev.Started(W[:2]))
    error = ValueError("the model factory failed")
    [fail] = d.send(ev.GroupFailed(0, error, rendezvous=False))
    assert fail == cmd.Fail(error=error)
    assert d.send(ev.WorkersLost(("tcp://a",))) == [fail]


def test_the_loop_runs_no_fail_of_its_own_after_a_loss():
    """Read from the source: ``FitLoop.apply`` stops at a loss and carries out nothing
    more of the list (the Fail is the machine's again, from the WorkersLost event)."""
    from dataflow.driver.loop import FitLoop

    tree = ast.parse(inspect.getsource(FitLoop.apply).strip().replace("\n    ", "\n"))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "_Fail" not in names and "Fail" not in names


def test_a_start_inside_a_phase_plans_that_phases_rest_first():
    d = Driver()
    d.send(ev.Started(W[:2], restore=True, epoch=0, step=3, in_phase=True))
    [plan] = d.send(ev.GroupFormed(0))
    assert plan == cmd.PlanSegment(cmd.SegmentKind.RESUMED, 2, None, 3)
    # the loop answers with the checkpoint's phase from step 3; the machine runs it on
    steps = planned(PHASE0, 2)
    out = d.send(ev.SegmentPlanned(PHASE0, steps, steps[3:], continued=True))
    [begin] = of(cmd.BeginPhase, out)
    assert begin.continued and begin.phase == PHASE0 and begin.steps[0].index == 3


def test_a_start_at_a_phase_boundary_asks_for_the_next_phase():
    d = Driver()
    d.send(ev.Started(W[:2], restore=True, epoch=2, step=8, previous=PHASE0))
    assert d.send(ev.GroupFormed(0)) == [cmd.ChoosePhase(2, PHASE0)]


def test_a_restart_from_a_mid_phase_checkpoint_plans_that_phases_rest():
    d = Driver(checkpoints=True)
    _, calibration = d.start()
    d.finish_plan(calibration)
    d.send(ev.WorkersLost(W[:2]))
    out = d.send(ev.RestartPoint(step=2, workers=W[2:], in_phase=True))
    [form] = of(cmd.FormGroup, out)
    assert d.send(ev.GroupFormed(form.generation)) == [
        cmd.PlanSegment(cmd.SegmentKind.RESUMED, 1, None, 2)
    ]
    # a later regroup of the same fit plans the rest from the commit, not a resume
    assert not d.state.resume_in_phase


def test_a_restart_takes_as_many_workers_as_the_fit_may_have_and_pools_the_rest():
    """The executor reports every worker that came back; the machine picks the fit's
    (``max_replicas``), the others wait in its pool as spares."""
    d = Driver(checkpoints=True, max_replicas=2)
    _, calibration = d.start()
    d.finish_plan(calibration)
    assert d.send(ev.WorkersLost(W[:2])) == [cmd.AwaitRestart(1, 2, 60.0, 10.0)]
    back = ("tcp://c", "tcp://d", "tcp://e")
    record, _, form = d.send(ev.RestartPoint(step=0, workers=back))
    assert form.members == back[:2] and d.state.available == back[2:]
    assert record.record["replicas_after"] == 2
