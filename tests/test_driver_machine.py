"""The fit state machine alone: every recovery path as a scripted event sequence.

No cluster, no torch work: each test feeds events and checks the commands, in
milliseconds. The executor tests on a real LocalCluster (test_lost_worker.py,
test_elastic.py, test_mid_phase_checkpoints.py...) prove the commands' effects.
"""

from __future__ import annotations

import dataclasses

import pytest

import dataflow as dfl
from dataflow.core.phase import PhaseSpec
from dataflow.core.window import WindowResult
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.fit_settings import WorkerScaling, WorkersWanted
from dataflow.driver.log import loggable
from dataflow.driver.machine import FitMachine, MachineConfig, replay
from dataflow.driver.state import Status
from dataflow.errors import ReplicaError
from dataflow.planning.plan import phase_steps, resplit_steps

W = ("tcp://a", "tcp://b", "tcp://c")


def even(size: int, n: int) -> tuple[int, ...]:
    return tuple(size // n + (1 if r < size % n else 0) for r in range(n))


def planned(phase: PhaseSpec, n: int, first: int = 0, samples: int = 32) -> tuple:
    return phase_steps(
        num_samples=samples, phase=phase, split=lambda b: even(b, n), first_index=first
    )


PHASE0 = PhaseSpec(index=0, start_epoch=0, end_epoch=2, global_batch=8)  # 8 steps


def result(rank: int, plan, window, *, seconds: float = 0.3, state=None) -> WindowResult:
    specs = plan.steps[window.first : window.stop]
    return WindowResult(
        rank=rank,
        first_step=specs[0].index,
        samples=[s.local_batches[rank] for s in specs],
        losses=[1.0] * len(specs),
        step_seconds=[seconds] * len(specs),
        stage_seconds={},
        task_seconds=seconds * len(specs),
        checkpoint=state,
    )


class Driver:
    """Plays the executor and the planner for a machine, as scripted as a test wants."""

    def __init__(self, **config) -> None:
        config.setdefault("window_seconds", 1.0)
        self.machine = FitMachine(MachineConfig(**config))
        self.out: list = []

    def send(self, event) -> list:
        commands = self.machine.handle(event)
        self.out.extend(commands)
        return commands

    @property
    def state(self):
        return self.machine.state

    def start(self, workers=W[:2], phase=PHASE0, spares=()) -> list:
        self.send(ev.Started(tuple(workers), spares=tuple(spares)))
        assert self.send(ev.GroupFormed(0)) == [cmd.ChoosePhase()]
        [plan_cmd] = self.send(ev.PhaseChosen(phase))
        assert isinstance(plan_cmd, cmd.PlanSegment)
        steps = planned(phase, len(workers))
        return self.send(ev.SegmentPlanned(phase, steps, steps))

    def finish_plan(self, submit: cmd.SubmitWindows, ranks=None, upto=None, **kw) -> list:
        """Every (or ``ranks``') window of ``submit``'s plan finishes, in order."""
        out = []
        ranks = range(len(submit.members)) if ranks is None else ranks
        for window in submit.plan.windows[:upto]:
            for r in ranks:
                state = {"r": r} if window.index in submit.checkpoints | submit.weights else None
                out += self.send(
                    ev.WindowDone(
                        submit.generation,
                        submit.first_window + window.index,
                        {r: result(r, submit.plan, window, state=state, **kw)},
                    )
                )
        return out


def of(kind, commands):
    return [c for c in commands if isinstance(c, kind)]


def test_a_fit_calibrates_then_fuses_windows_commits_in_order_and_finishes():
    d = Driver()
    begin, submit = d.start()
    assert isinstance(begin, cmd.BeginPhase) and begin.members == W[:2]
    assert [w.n_steps for w in submit.plan.windows] == [1, 1]  # calibration
    out = d.finish_plan(submit)
    assert len(of(cmd.CommitWindow, out)) == 2
    [train] = of(cmd.SubmitWindows, out)
    # 0.3 s steps, 1 s windows: 4 steps per window over the 6 steps left
    assert [w.n_steps for w in train.plan.windows] == [4, 2]
    out = d.finish_plan(train)
    assert isinstance(out[-1], cmd.EndPhase) and d.state.committed_step == 8
    out = d.send(ev.PhaseEnded(0, ({"weights_digest": "x"}, {"weights_digest": "x"})))
    assert [type(c) for c in out] == [cmd.RecordPhase, cmd.ChoosePhase]
    assert d.send(ev.PhaseChosen(None)) == [cmd.Finish(W[:2])]


def test_a_window_commits_only_when_every_replica_finished_it_and_in_order():
    d = Driver()
    _, submit = d.start()
    plan, (w0, w1) = submit.plan, submit.plan.windows
    assert d.send(ev.WindowDone(0, 1, {0: result(0, plan, w1)})) == []
    assert d.send(ev.WindowDone(0, 1, {1: result(1, plan, w1)})) == []  # window 0 first
    assert d.send(ev.WindowDone(0, 0, {0: result(0, plan, w0)})) == []
    out = d.send(ev.WindowDone(0, 0, {1: result(1, plan, w0)}))
    assert [c.window.index for c in of(cmd.CommitWindow, out)] == [0, 1]


def test_a_worker_lost_mid_window_salvages_what_its_partners_finished_and_regroups():
    d = Driver()
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    # replica 1 (worker b) dies after finishing window 0 but before its result came
    # back; replica 0 finished windows 0 and 1 of the trained plan
    d.finish_plan(train, ranks=[0])
    out = d.send(ev.WorkersLost(("tcp://b",)))
    commits = of(cmd.CommitWindow, out)
    assert [c.window.index for c in commits] == [0, 1]  # salvaged: b's partner finished
    assert commits[0].results[1] is None  # b's samples follow from the plan
    kinds = [type(c) for c in out]
    assert kinds[-4:] == [cmd.RecordFailure, cmd.StopWindows, cmd.RollBack, cmd.FormGroup]
    rollback, form = out[-2], out[-1]
    assert rollback.members == ("tcp://a",) and rollback.step == 8
    assert form.generation == 1 and form.members == ("tcp://a",)
    # the stale group's results are ignored
    assert d.send(ev.WindowDone(0, 3, {0: None})) == []


def scored(res: WindowResult, plan, window, count: int) -> WindowResult:
    """``res`` with the held-out scores of ``count`` samples at its window's last step
    (an epoch's end)."""
    res.evals = {plan.steps[window.stop - 1].index: {"count": count, "loss": 0.5 * count}}
    return res


def test_a_window_whose_lost_replica_held_part_of_the_held_out_scores_is_trained_again():
    """Replica 1 finished a window that ended an epoch and died before its result came
    back: its share of the held-out scores died with it. The window is not salvaged
    (an epoch would report a score over part of the held-out set): the survivor rolls
    back to the commit before it and trains it again."""
    d = Driver(held_out_samples=300)
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    w0 = train.plan.windows[0]
    d.send(
        ev.WindowDone(
            0, train.first_window, {0: scored(result(0, train.plan, w0), train.plan, w0, 150)}
        )
    )
    out = d.send(ev.WorkersLost(("tcp://b",)))
    assert not of(cmd.CommitWindow, out)
    [rollback] = of(cmd.RollBack, out)
    assert rollback.members == ("tcp://a",) and rollback.step == 2  # before the window
    [record] = of(cmd.RecordFailure, out)
    assert record.record["window_steps_lost"] == w0.n_steps


def test_a_window_whose_scores_cover_the_held_out_set_is_still_salvaged():
    d = Driver(held_out_samples=300)
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    w0 = train.plan.windows[0]
    d.send(
        ev.WindowDone(
            0, train.first_window, {0: scored(result(0, train.plan, w0), train.plan, w0, 300)}
        )
    )
    out = d.send(ev.WorkersLost(("tcp://b",)))
    assert [c.window.index for c in of(cmd.CommitWindow, out)] == [0]


def test_async_a_finished_window_missing_a_lost_share_of_scores_rolls_back_not_releases():
    """Under Async the survivors finished the window that scored the epoch, the lost
    replica's result (its scores) never came: there is nothing in flight to release,
    so the survivors roll back and train it again (its scores then cover the whole set:
    the evaluation is shared over the survivors)."""
    from dataflow.sync import Async

    d = Driver(sync=Async(staleness=1), held_out_samples=300)
    _, calibration = d.start(workers=W)
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    w0 = train.plan.windows[0]
    for r in (0, 1):
        d.send(
            ev.WindowDone(
                0, train.first_window, {r: scored(result(r, train.plan, w0), train.plan, w0, 100)}
            )
        )
    out = d.send(ev.WorkersLost(("tcp://c",)))
    assert not of(cmd.ReleaseReplicas, out) and not of(cmd.CommitWindow, out)
    [rollback] = of(cmd.RollBack, out)
    assert rollback.members == W[:2] and rollback.step == 2


def test_a_window_the_survivors_trained_past_is_salvaged_with_its_partial_scores():
    """Asynchronous updates run ahead of the driver's commits: when a survivor already
    finished a later window, its replica no longer holds the start of the window that
    lacks the lost share of scores, so that window is salvaged (the recorder then
    records the epoch's evaluation as partial) rather than rolled back past reach."""
    from dataflow.sync import Async

    d = Driver(sync=Async(staleness=1), held_out_samples=300)
    _, calibration = d.start(workers=W)
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    w0, w1 = train.plan.windows[:2]
    for r in (0, 1):
        done = scored(result(r, train.plan, w0), train.plan, w0, 100)
        d.send(ev.WindowDone(0, train.first_window, {r: done}))
    d.send(ev.WindowDone(0, train.first_window + 1, {0: result(0, train.plan, w1)}))
    out = d.send(ev.WorkersLost(("tcp://c",)))
    commits = of(cmd.CommitWindow, out)
    assert commits and commits[0].window.index == 0 and commits[0].results[2] is None


def test_a_loss_before_any_partner_finished_rolls_back_to_the_last_commit():
    d = Driver()
    _, calibration = d.start()
    d.finish_plan(calibration)  # the trained plan is submitted, nothing of it finished
    out = d.send(ev.WorkersLost(("tcp://a",)))
    assert not of(cmd.CommitWindow, out)
    [record] = of(cmd.RecordFailure, out)
    assert record.record["commit_step"] == 2 and record.record["window_steps_lost"] == 4
    [rollback] = of(cmd.RollBack, out)
    assert rollback.members == ("tcp://b",) and rollback.step == 2
    # regrouped, the planner re-splits the rest of the phase over one replica
    [plan_rest] = d.send(ev.GroupFormed(1))
    assert dataclasses.replace(plan_rest, segment=(), phase_steps=()) == cmd.PlanSegment(
        "rest", 1, PHASE0, 2
    )
    assert plan_rest.segment and plan_rest.phase_steps  # what the re-split needs
    rest = resplit_steps(planned(PHASE0, 2), 2, split=lambda b: (b,))
    begin, submit = d.send(ev.SegmentPlanned(PHASE0, planned(PHASE0, 2), rest, continued=True))
    assert begin.continued and begin.members == ("tcp://b",)
    assert submit.generation == 1 and submit.plan.steps[0].index == 2


def test_every_replica_lost_restarts_from_the_newest_checkpoint_within_the_budget():
    d = Driver(checkpoints=True, max_restarts=2)
    _, calibration = d.start()
    d.finish_plan(calibration)
    assert d.send(ev.WorkersLost(W[:2])) == [cmd.AwaitRestart(1, 2, 60.0, 10.0)]
    for _ in range(2):
        out = d.send(ev.RestartPoint(step=0, workers=("tcp://c",)))
        [record] = of(cmd.RecordFailure, out)
        assert record.record["restarted_from_step"] == 0
        assert of(cmd.Restart, out) == [cmd.Restart(0)]
        [form] = of(cmd.FormGroup, out)
        assert form.fresh and form.restore and form.members == ("tcp://c",)
        # every one lost again while starting: wait for workers once more
        assert d.send(ev.WorkersLost(("tcp://c",))) == [cmd.AwaitRestart(1, 1, 60.0, 10.0)]
    [fail] = d.send(ev.RestartPoint(step=0, workers=("tcp://c",)))
    assert isinstance(fail, cmd.Fail) and fail.restarts_from == 0


def test_replicas_lost_one_event_at_a_time_restart_waiting_for_as_many_as_the_fit_had():
    """Two workers killed at once reach the driver as two losses: the first regroups the
    survivor (its layout shrinks to one), the second leaves none before that group
    formed. The restart still waits a little for the two replicas the fit ran with, not
    the one of a group that never formed (it restarted on one worker, found 2026-12-02)."""
    d = Driver(checkpoints=True)
    _, calibration = d.start()
    d.finish_plan(calibration)
    out = d.send(ev.WorkersLost(W[:1]))
    [form] = of(cmd.FormGroup, out)
    assert form.members == W[1:2]
    assert d.send(ev.WorkersLost(W[1:2]))[-1] == cmd.AwaitRestart(1, 2, 60.0, 10.0)
    out = d.send(ev.RestartPoint(step=0, workers=("tcp://c",)))  # one came back in time
    assert of(cmd.FormGroup, out)[0].members == ("tcp://c",)
    # lost again before that group formed: the fit has one replica since the restart
    assert d.send(ev.WorkersLost(("tcp://c",))) == [cmd.AwaitRestart(1, 1, 60.0, 10.0)]


def test_a_loss_while_restarting_goes_on_with_the_workers_left():
    d = Driver(checkpoints=True)
    d.start()
    d.send(ev.WorkersLost(W[:2]))
    d.send(ev.RestartPoint(step=0, workers=W))
    record, form = d.send(ev.WorkersLost(("tcp://a",)))
    assert record.record["lost"] == ["tcp://a"] and record.record["replicas_after"] == 2
    assert form.fresh and form.restore and form.members == W[1:]
    assert d.state.restarts == {0: 1}  # the same restart, not a new one


def test_every_replica_lost_before_the_first_checkpoint_starts_again_from_step_0():
    """Issue 35: with a checkpoint folder but no checkpoint written yet, a fit that loses
    every replica starts again from step 0 on the workers that came back (the replicas
    build the initial weights), the loss recorded, within the restart budget."""
    d = Driver(checkpoints=True, max_restarts=2)
    _, calibration = d.start()
    d.finish_plan(calibration)  # steps 0-1 committed, then every replica lost
    assert d.send(ev.WorkersLost(W[:2])) == [cmd.AwaitRestart(1, 2, 60.0, 10.0)]
    for _ in range(2):
        record, restart, form = d.send(ev.RestartPoint(step=None, workers=W[2:]))
        assert record.record["reason"] == "every replica lost"
        assert record.record["restarted_from_step"] == 0 and record.record["replicas_after"] == 1
        assert restart == cmd.Restart(0, from_start=True)
        assert form.fresh and not form.restore and form.members == W[2:]
        assert d.send(ev.GroupFormed(form.generation)) == [cmd.ChoosePhase(0, None)]
        assert d.state.committed_step == 0 and d.state.next_step == 0
        assert d.send(ev.WorkersLost(W[2:])) == [cmd.AwaitRestart(1, 1, 60.0, 10.0)]
    [fail] = d.send(ev.RestartPoint(step=None, workers=W[2:]))
    assert isinstance(fail, cmd.Fail) and fail.restarts_from == 0


def test_a_group_lost_whole_is_over_its_answers_that_come_after_are_stale():
    """Every replica lost while the phase ends (or while a group forms): the fit waits
    for workers, and what the lost group sent before it died, arriving after the loss
    (its phase's end, its forming's outcome), is stale: it neither moves the machine nor
    breaks it (found by test_driver_simulated's random faults: a PhaseEnded while
    restarting had no rule and stopped the fit with InvalidTransition)."""
    d = Driver()
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    [end] = of(cmd.EndPhase, d.finish_plan(train))
    assert d.send(ev.WorkersLost(W[:2])) == [cmd.AwaitRestart(1, 2, 60.0, 10.0)]
    assert d.send(ev.PhaseEnded(end.generation, ({"weights_digest": "x"},) * 2)) == []
    assert d.state.status == Status.RESTARTING
    _, restart, form = d.send(ev.RestartPoint(step=None, workers=W[2:]))
    assert restart.from_start and form.generation > end.generation
    assert d.send(ev.GroupFormed(form.generation)) == [cmd.ChoosePhase(0, None)]

    for late in (
        lambda g: ev.GroupFormed(g),
        lambda g: ev.GroupFailed(g, RuntimeError("rendezvous timed out")),
        lambda g: ev.SetupFailed(g, (W[0],), ImportError("no module named netCDF4")),
    ):
        d = Driver(checkpoints=True)
        [form] = d.send(ev.Started(W[:2]))
        d.send(ev.WorkersLost(W[:2]))
        assert d.send(late(form.generation)) == []
        assert d.state.status == Status.RESTARTING


def test_a_restart_counts_a_worker_named_twice_once():
    """An executor that names an address twice among the workers back (found with a
    simulated one whose worker joined twice) still forms one replica per worker."""
    d = Driver(checkpoints=True)
    d.start()
    d.send(ev.WorkersLost(W[:2]))
    out = d.send(ev.RestartPoint(step=0, workers=("tcp://c", "tcp://c")))
    [form] = of(cmd.FormGroup, out)
    assert form.members == ("tcp://c",)
    assert d.state.available == ()


def test_the_steps_a_restart_from_step_0_redoes_are_recorded():
    d = Driver(checkpoints=True)
    _, calibration = d.start()
    d.finish_plan(calibration)
    d.send(ev.WorkersLost(W[:2]))
    [record, *_] = d.send(ev.RestartPoint(step=None, workers=W))
    assert record.record["commit_step"] == 2 and record.record["window_steps_lost"] == 2 + 4
    assert record.record["lost"] == list(W[:2]) and record.record["replicas_before"] == 2


def test_every_worker_lost_while_the_first_group_forms_waits_for_workers():
    """With a checkpoint folder, a fit whose every worker dies while its first group
    forms starts from step 0 on the restarted ones; no workers back: it fails."""
    d = Driver(checkpoints=True)
    d.send(ev.Started(W[:2]))
    assert d.send(ev.WorkersLost(W[:2])) == [cmd.AwaitRestart(1, 2, 60.0, 10.0)]
    [fail] = d.send(ev.RestartPoint(step=None, workers=()))
    assert isinstance(fail, cmd.Fail) and fail.lost == W[:2] and fail.restarts_from is None
    d = Driver(checkpoints=True)
    d.send(ev.Started(W[:2]))
    d.send(ev.WorkersLost(W[:2]))
    record, restart, form = d.send(ev.RestartPoint(step=None, workers=W[2:]))
    assert record.record["restarted_from_step"] == 0 and restart.from_start
    assert form.members == W[2:] and not form.restore


def test_every_replica_lost_without_checkpoints_starts_again_from_step_0_or_fails():
    """No checkpoint folder: the fit waits for workers and starts again from step 0
    rather than fail a fit they could finish; none back, it fails naming the lost."""
    d = Driver()
    _, calibration = d.start()
    d.finish_plan(calibration)
    assert d.send(ev.WorkersLost(W[:2])) == [cmd.AwaitRestart(1, 2, 60.0, 10.0)]
    record, restart, form = d.send(ev.RestartPoint(step=None, workers=W[2:]))
    assert record.record["restarted_from_step"] == 0 and restart.from_start
    assert form.members == W[2:] and not form.restore
    d = Driver()
    d.start()
    d.send(ev.WorkersLost(W[:2]))
    [fail] = d.send(ev.RestartPoint(step=None, workers=()))
    assert isinstance(fail, cmd.Fail) and fail.lost == W[:2] and fail.remain == 0


def test_too_few_workers_checkpoints_the_commit_then_fails():
    d = Driver(min_workers=2, checkpoints=True)
    _, calibration = d.start()
    d.finish_plan(calibration)
    out = d.send(ev.WorkersLost(("tcp://b",)))
    kinds = [type(c) for c in out]
    assert kinds == [
        cmd.RecordFailure,
        cmd.StopWindows,
        cmd.RollBack,
        cmd.WriteCheckpoint,
        cmd.Fail,
    ]
    save, fail = out[-2], out[-1]
    assert save.kind == "survivors" and save.step == 2 and save.members == ("tcp://a",)
    assert fail.remain == 1 and fail.commit_step == 2
    assert d.send(ev.Timer()) == []  # a failed fit decides nothing more


def test_a_worker_that_joined_meanwhile_keeps_the_fit_above_min_workers():
    d = Driver(min_workers=2)
    d.start()
    d.send(ev.WorkersJoined(("tcp://c",)))
    out = d.send(ev.WorkersLost(("tcp://b",)))
    [form] = of(cmd.FormGroup, out)
    assert form.members == ("tcp://a", "tcp://c") and form.joining == ("tcp://c",)
    assert of(cmd.RecordFailure, out)[0].record["joined"] == ["tcp://c"]


def test_workers_join_at_a_phase_boundary_and_the_next_phase_is_planned_for_them():
    d = Driver(max_replicas=3)
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.send(ev.WorkersJoined(("tcp://c", "tcp://d")))  # d is over max_replicas
    d.finish_plan(train)
    d.send(ev.PhaseEnded(0, ({"weights_digest": "x"},) * 2))
    phase1 = PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=16)
    [form] = d.send(ev.PhaseChosen(phase1))
    assert form.members == W and form.joining == ("tcp://c",) and form.generation == 1
    assert d.send(ev.GroupFormed(1)) == [
        cmd.PlanSegment("phase", 3, phase=phase1, commit_step=8)
    ]  # from step 8


def test_spares_left_out_of_the_first_group_replace_a_lost_replica_not_grow_the_fit():
    """``replicas=2`` (or ``max_workers=2``) on 3 workers: the third is a spare. It does
    not join at a phase boundary (the fit has its 2), but it replaces a lost replica."""
    d = Driver(max_replicas=2)
    _, calibration = d.start(spares=("tcp://c",))
    assert d.state.available == ("tcp://c",)
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.finish_plan(train)
    d.send(ev.PhaseEnded(0, ({"weights_digest": "x"},) * 2))
    phase1 = PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=16)
    [plan] = d.send(ev.PhaseChosen(phase1))  # no FormGroup: nobody joins
    assert isinstance(plan, cmd.PlanSegment) and plan.replicas == 2
    d.send(ev.SegmentPlanned(phase1, planned(phase1, 2, first=8), planned(phase1, 2, first=8)))
    out = d.send(ev.WorkersLost(("tcp://b",)))
    [form] = of(cmd.FormGroup, out)
    assert form.members == ("tcp://a", "tcp://c") and form.joining == ("tcp://c",)
    assert of(cmd.RecordFailure, out)[0].record["joined"] == ["tcp://c"]


def joining_at_phase_1(d: Driver) -> cmd.FormGroup:
    """Phase 0 trains on a and b while c joins the client; the FormGroup that brings c in
    at phase 1."""
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.send(ev.WorkersJoined(("tcp://c",)))
    d.finish_plan(train)
    d.send(ev.PhaseEnded(0, ({"weights_digest": "x"},) * 2))
    phase1 = PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=16)
    [form] = of(cmd.FormGroup, d.send(ev.PhaseChosen(phase1)))
    return form


def test_a_loss_while_joiners_join_forms_the_group_again_without_them():
    d = Driver()
    joining_at_phase_1(d)
    record, form = d.send(ev.WorkersLost(("tcp://c",)))
    assert form.members == W[:2] and form.joining == () and form.generation == 2
    # the joiner's loss is recorded too (issue 35): it cost the forming, no step
    assert record.record["lost"] == ["tcp://c"] and record.record["window_steps_lost"] == 0
    assert record.record["replicas_before"] == 3 and record.record["replicas_after"] == 2


def test_a_joiner_whose_own_setup_fails_is_excluded_and_the_group_forms_without_it():
    """A joining worker raised its own error setting up (a node without a library the
    model needs): it is excluded for good, the loss recorded with the error, and the
    members form the group again without it (it is not put back in the pool)."""
    d = Driver()
    form = joining_at_phase_1(d)
    assert form.joining == ("tcp://c",)
    error = ModuleNotFoundError("No module named 'libfoo'")
    exclude, record, again = d.send(ev.SetupFailed(form.generation, ("tcp://c",), error))
    assert exclude == cmd.ExcludeWorkers(("tcp://c",), for_good=True)
    assert record.record["reason"] == "a worker failed to set up"
    assert record.record["error"] == "ModuleNotFoundError: No module named 'libfoo'"
    assert record.record["lost"] == ["tcp://c"] and record.record["window_steps_lost"] == 0
    assert again.members == W[:2] and again.joining == () and "tcp://c" not in d.state.available
    # a stale answer (an older forming) changes nothing
    assert d.send(ev.SetupFailed(form.generation, ("tcp://c",), error)) == []


def test_the_same_setup_error_on_a_second_worker_is_the_fits_and_stops_it():
    """Rank 1's setup raises (the user's code fails on that rank, whichever worker holds
    it): the first time it looks like a node's fault and b is left out; when c, rank 1
    of the group formed again, raises the same error, the fit stops with it rather than
    leave out one worker per try until one remains. A different error on another worker
    is still a node's."""
    d = Driver()
    [form] = d.send(ev.Started(W))
    error = ValueError("rank 1 has no head\n(traceback lines differ)")
    _, record, again = d.send(ev.SetupFailed(form.generation, ("tcp://b",), error))
    assert record.record["error"] == "ValueError: rank 1 has no head"
    assert again.members == ("tcp://a", "tcp://c")
    [fail] = d.send(
        ev.SetupFailed(again.generation, ("tcp://c",), ValueError("rank 1 has no head"))
    )
    assert isinstance(fail, cmd.Fail) and str(fail.error) == "rank 1 has no head"
    assert d.state.status == Status.FAILED
    d = Driver()
    [form] = d.send(ev.Started(W))
    _, _, again = d.send(ev.SetupFailed(form.generation, ("tcp://b",), OSError("no GPU here")))
    out = d.send(ev.SetupFailed(again.generation, ("tcp://c",), OSError("disk full")))
    assert not of(cmd.Fail, out) and of(cmd.ExcludeWorkers, out)


def test_a_spatial_first_group_forms_without_the_group_of_a_worker_that_cannot_set_up():
    """Two groups of two workers; b cannot set up: its group is gone, its partner waits
    in the pool, the other group forms again (fresh: nothing was trained)."""
    workers = tuple(f"tcp://{c}" for c in "abcd")
    d = Driver(spatial=2)
    [form] = d.send(ev.Started(workers))
    exclude, record, again = d.send(ev.SetupFailed(form.generation, ("tcp://b",), OSError()))
    assert exclude.workers == ("tcp://b",) and record.record["lost"] == ["tcp://b"]
    assert again.fresh and again.groups == (("tcp://c", "tcp://d"),)
    assert d.state.available == ("tcp://a",)


def test_mid_phase_checkpoints_follow_the_cadence_and_never_the_phase_end():
    d = Driver(checkpoints=True, checkpoint_every=2)
    _, calibration = d.start()
    out = d.finish_plan(calibration)
    [train] = of(cmd.SubmitWindows, out)
    out += d.finish_plan(train, seconds=0.01)  # windows of 6 steps: one, ending the phase
    writes = of(cmd.WriteCheckpoint, out)
    assert [(w.kind, w.step) for w in writes] == [("window", 2)]
    assert writes[0].states == ({"r": 0}, {"r": 1})


def test_nan_rolls_back_in_place_with_half_the_lr_until_the_budget_is_spent():
    d = Driver(roll_back_non_finite=True, max_rollbacks=2)
    _, submit = d.start()
    [fail] = d.send(ev.WindowFailed(0, 0, submit.first_window, ValueError("no NaN")))
    assert isinstance(fail, cmd.Fail)  # any other failure stops the fit
    d = Driver(roll_back_non_finite=True, max_rollbacks=2)
    _, submit = d.start()
    for attempt in range(2):
        out = d.send(
            ev.WindowFailed(0, 0, submit.first_window, FloatingPointError(), non_finite=True)
        )
        stop, rollback = of(cmd.StopWindows, out)[0], of(cmd.RollBack, out)[0]
        assert not stop.leave_group and not rollback.leave_group  # the group stays
        assert d.state.generation == 0 and d.state.lr_factor == 0.5 ** (attempt + 1)
        steps = planned(PHASE0, 2)
        begin, submit = d.send(ev.SegmentPlanned(PHASE0, steps, steps, continued=True))
        assert begin.lr_factor == 0.5 ** (attempt + 1)
    [fail] = d.send(ev.WindowFailed(0, 1, submit.first_window, FloatingPointError(), True))
    assert isinstance(fail, cmd.Fail)


def test_a_collective_timed_out_on_a_live_peer_is_redone_from_the_commit_then_fails():
    """Every worker alive (the executor checked), a replica's allreduce timed out: a peer
    was slow (a data stall), so the phase's rest is redone from the commit with the group
    formed again, ``max_stalls`` times in a phase; then the fit stops saying which
    timeout to raise. Any other collective error still stops it at once."""
    from dataflow.core.errors import CollectiveError
    from dataflow.driver.log import ErrorInfo

    timeout = CollectiveError(
        "allreduce failed on replica 0: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 3000ms for recv operation to complete; another replica (or the driver) most "
        "likely failed first"
    )
    d = Driver(max_stalls=2)
    _, submit = d.start()
    for attempt, error in enumerate((timeout, ErrorInfo.of(timeout))):  # a replayed log too
        out = d.send(ev.WindowFailed(attempt, 0, submit.first_window, error))
        [record] = [c.record for c in of(cmd.RecordFailure, out)]
        assert record["reason"] == "stalled" and record["rank"] == 0 and record.lost == []
        assert of(cmd.StopWindows, out) and of(cmd.RollBack, out)[0].step == 0
        [form] = of(cmd.FormGroup, out)
        assert form.members == W[:2] and form.generation == attempt + 1
        [plan] = d.send(ev.GroupFormed(attempt + 1))
        assert plan.kind == "rest" and plan.replicas == 2 and plan.commit_step == 0
        steps = planned(PHASE0, 2)
        _, submit = d.send(ev.SegmentPlanned(PHASE0, steps, steps, continued=True))
    [fail] = d.send(ev.WindowFailed(2, 1, submit.first_window, timeout))
    assert isinstance(fail, cmd.Fail) and isinstance(fail.error, CollectiveError)
    assert "after 2 redo(s)" in str(fail.error) and "collective_timeout_s" in str(fail.error)
    assert fail.error.__cause__ is timeout
    d = Driver()
    _, submit = d.start()
    closed = CollectiveError("allreduce failed on replica 0: Connection closed by peer")
    [fail] = d.send(ev.WindowFailed(0, 0, submit.first_window, closed))
    assert fail == cmd.Fail(error=closed)


@pytest.mark.parametrize(
    "sync", [dfl.sync.Local(period_steps=2), dfl.sync.Async(staleness=2)], ids=["local", "async"]
)
def test_a_slow_replica_dropped_under_local_or_async_is_not_released_but_rolled_back(sync):
    """Under Async and Local a lost replica's peers may finish the window in flight
    without it (a release). A slow one is dropped after the others' wait timed out:
    their window failed, nothing is left to finish, so the survivors roll back and
    regroup (a release used to wait for a window that no longer ran)."""
    from dataflow.core.errors import CollectiveError

    timeout = CollectiveError("allreduce failed on replica 0: Timed out waiting 3000ms")
    d = Driver(max_stalls=0, checkpoints=False, sync=sync)
    _, submit = d.start()
    out = d.send(ev.WindowFailed(0, 0, submit.first_window, timeout, slow=(1,)))
    assert not of(cmd.ReleaseReplicas, out) and d.state.releasing == ()
    [rollback] = of(cmd.RollBack, out)
    [form] = of(cmd.FormGroup, out)
    assert form.members == (W[0],) and rollback.step == 0


def test_a_replica_that_stalls_the_phase_past_max_stalls_is_dropped_as_a_slow_one():
    """The executor names the replicas still in their step once the others' wait timed
    out (``slow``): each stall's record says which; past ``max_stalls`` those replicas
    go as a lost worker would (excluded), and the fit goes on with the others, where it
    would stop for one bad node. Without a name, or when every replica was slow, the fit
    stops as before; the log replays to the same commands."""
    from dataflow.core.errors import CollectiveError
    from dataflow.driver.log import loggable
    from dataflow.driver.machine import replay

    timeout = CollectiveError("allreduce failed on replica 0: Timed out waiting 3000ms")
    d = Driver(max_stalls=1, checkpoints=False)
    _, submit = d.start()
    out = d.send(ev.WindowFailed(0, 0, submit.first_window, timeout, slow=(1,)))
    [record] = [c.record for c in of(cmd.RecordFailure, out)]
    assert record["reason"] == "stalled" and record["slow_replicas"] == [1]
    d.send(ev.GroupFormed(1))
    steps = planned(PHASE0, 2)
    _, submit = d.send(ev.SegmentPlanned(PHASE0, steps, steps, continued=True))
    out = d.send(ev.WindowFailed(1, 0, submit.first_window, timeout, slow=(1,)))
    assert out[0] == cmd.ExcludeWorkers((W[1],))
    [record] = [c.record for c in of(cmd.RecordFailure, out)]
    assert record["reason"] == "slow replica dropped" and record["lost"] == [W[1]]
    assert record["slow_replicas"] == [1] and record["replicas_after"] == 1
    assert "Timed out" in record["error"]
    assert d.state.status != "failed"
    _, replayed = replay(d.machine.config, d.machine.log.events)
    assert [loggable(c) for out in replayed for c in out] == d.machine.log.commands
    for slow in ((), (0, 1)):  # nobody named, or every replica: the fit stops
        d = Driver(max_stalls=0)
        _, submit = d.start()
        [fail] = d.send(ev.WindowFailed(0, 0, submit.first_window, timeout, slow=slow))
        assert isinstance(fail, cmd.Fail) and "after 0 redo(s)" in str(fail.error)


def test_diverged_weights_fail_the_fit():
    d = Driver()
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.finish_plan(train)
    [fail] = d.send(ev.PhaseEnded(0, ({"weights_digest": "x"}, {"weights_digest": "y"})))
    assert isinstance(fail.error, ReplicaError)


def test_a_loss_while_starting_goes_on_with_the_rest_or_fails_below_min_workers():
    d = Driver()
    d.send(ev.Started(W))
    record, form = d.send(ev.WorkersLost(("tcp://a",)))
    assert form.fresh and form.members == W[1:] and form.generation == 1
    # recorded like any loss (issue 35: it used to leave no entry): nothing trained yet
    assert isinstance(record, cmd.RecordFailure) and record.record["reason"] == "lost workers"
    assert record.record["lost"] == ["tcp://a"] and record.record["commit_step"] == 0
    assert record.record["replicas_before"] == 3 and record.record["replicas_after"] == 2
    assert record.record["window_steps_lost"] == 0 and record.record["phase"] is None
    d = Driver(min_workers=3)
    d.send(ev.Started(W))
    [fail] = d.send(ev.WorkersLost(("tcp://a",)))
    assert fail.starting and fail.remain == 2


def test_a_spare_takes_the_place_of_a_worker_lost_while_the_first_group_forms():
    """``replicas=2`` on 3 workers: the third waits as a spare. A worker lost before the
    first group formed is replaced by it (the fit keeps its 2 replicas), and a fit that
    takes no joins (``elastic=False``) goes on with the one left."""
    d = Driver(max_replicas=2)
    d.send(ev.Started(W[:2], spares=(W[2],)))
    record, form = d.send(ev.WorkersLost((W[0],)))
    assert form.fresh and form.members == (W[1], W[2]) and form.generation == 1
    assert record.record["joined"] == [W[2]] and record.record["replicas_after"] == 2
    assert d.state.available == ()
    d = Driver(max_replicas=2, may_join=False)
    d.send(ev.Started(W[:2], spares=(W[2],)))
    record, form = d.send(ev.WorkersLost((W[0],)))
    assert form.members == (W[1],) and record.record["joined"] == []
    d = Driver(max_replicas=2, min_workers=2)  # the spare keeps the fit above min_workers
    d.send(ev.Started(W[:2], spares=(W[2],)))
    [_, form] = d.send(ev.WorkersLost((W[0],)))
    assert form.members == (W[1], W[2])


def test_the_log_replays_to_the_same_decisions():
    d = Driver(checkpoints=True, checkpoint_every=1)
    _, calibration = d.start()
    d.finish_plan(calibration)
    d.send(ev.WorkersLost(("tcp://b",)))
    machine, replayed = replay(d.machine.config, d.machine.log.events)
    live = [loggable(c) for c in d.out]  # replica states as markers, errors as text
    assert [loggable(c) for commands in replayed for c in commands] == live
    assert d.machine.log.commands == live  # the log holds what the machine decided
    assert any(isinstance(c, cmd.WriteCheckpoint) for c in live)
    # the same state, but for the last results (the replay's hold markers, not weights)
    assert dataclasses.replace(machine.state, last_results=()) == dataclasses.replace(
        d.machine.state, last_results=()
    )


@pytest.mark.parametrize("status", ["ending", "boundary"])
def test_a_loss_at_the_phase_end_regroups_and_does_that_step_again(status):
    d = Driver(checkpoints=True)
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.finish_plan(train)
    if status == "boundary":
        d.send(ev.PhaseEnded(0, ({"weights_digest": "x"},) * 2))
    out = d.send(ev.WorkersLost(("tcp://b",)))
    assert of(cmd.FormGroup, out)[0].members == ("tcp://a",)
    again = d.send(ev.GroupFormed(1))
    if status == "ending":
        assert again == [cmd.EndPhase(1, ("tcp://a",))]
    else:
        assert [type(c) for c in again] == [cmd.WriteCheckpoint, cmd.ChoosePhase]


def test_a_group_that_fails_to_form_is_formed_again_then_the_error_stands():
    d = Driver(max_group_retries=2)
    d.send(ev.Started(W[:2]))
    for generation in (1, 2):
        [form] = d.send(ev.GroupFailed(generation - 1, RuntimeError("connect timeout")))
        assert form.fresh and form.generation == generation and form.members == W[:2]
    [fail] = d.send(ev.GroupFailed(2, RuntimeError("connect timeout")))
    assert isinstance(fail, cmd.Fail) and "connect timeout" in str(fail.error)
    # a regroup (joiners at a boundary) is retried as a regroup, joiners and all
    d = Driver()
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.send(ev.WorkersJoined(("tcp://c",)))
    d.finish_plan(train)
    d.send(ev.PhaseEnded(0, ({"weights_digest": "x"},) * 2))
    d.send(ev.PhaseChosen(PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=16)))
    [form] = d.send(ev.GroupFailed(1, RuntimeError("stalled")))
    assert not form.fresh and form.joining == ("tcp://c",) and form.generation == 2
    assert d.send(ev.GroupFormed(2)) == [cmd.PlanSegment("phase", 3, d.state.next_phase, 8)]


def test_the_users_own_error_while_forming_stops_the_fit_at_once():
    """A model factory that raises is no rendezvous failure: no retry mends it, so the
    machine stops the fit with that error (the loop only reports it)."""
    d = Driver(max_group_retries=2)
    d.send(ev.Started(W[:2]))
    error = ValueError("the model factory raised")
    [fail] = d.send(ev.GroupFailed(0, error, rendezvous=False))
    assert fail == cmd.Fail(error=error) and d.state.status == "failed"


def _async_driver(workers=W, servers=1):
    from dataflow.sync import Async

    d = Driver(sync=Async(staleness=1, servers=servers))
    _, calibration = d.start(workers=workers)
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    return d, train


def test_async_a_lost_replica_is_released_and_the_survivors_keep_the_window_in_flight():
    """Asynchronous updates, replica 2 (not a store host) lost mid-window: nothing is
    rolled back at once. The survivors are told to finish the window in flight without
    it; once it commits they regroup from its end, and the record says nothing was
    lost but what they trained again."""
    d, train = _async_driver()
    w0 = train.plan.windows[0]
    out = d.send(ev.WorkersLost(("tcp://c",)))
    opened, release = out  # the record opens now (detected_at), and is updated later
    assert opened.record["lost"] == ["tcp://c"] and opened.record["kept_window"] is False
    assert isinstance(release, cmd.ReleaseReplicas)
    assert release.members == W[:2] and release.lost == (2,) and release.workers == ("tcp://c",)
    assert release.window == train.first_window and release.stop_step == 2 + w0.n_steps
    assert d.send(ev.WindowDone(0, train.first_window, {0: result(0, train.plan, w0)})) == []
    survivor = result(1, train.plan, w0)
    survivor.retrained = [(2, 2)]
    out = d.send(ev.WindowDone(0, train.first_window, {1: survivor}))
    kinds = [type(c) for c in out]
    assert kinds == [
        cmd.CommitWindow,
        cmd.RecordFailure,
        cmd.StopWindows,
        cmd.RollBack,
        cmd.FormGroup,
    ]
    assert out[0].results[2] is None  # the lost replica's samples: the rest of each step
    assert out[1].update
    record = out[1].record
    assert record["kept_window"] and record["window_steps_lost"] == 0
    assert record["retrained_parts"] == 1 and record["commit_step"] == 2 + w0.n_steps
    assert out[3].step == 2 + w0.n_steps and out[4].members == W[:2]


def test_async_a_lost_store_host_or_a_failed_release_rolls_back():
    """A lost shard host takes the store's state with it: roll back to the commit. So
    does a second loss while the survivors finish the released window, or its failure."""
    d, _ = _async_driver()
    out = d.send(ev.WorkersLost(("tcp://a",)))  # replica 0 hosts the store's shard
    assert [type(c) for c in out][-3:] == [cmd.StopWindows, cmd.RollBack, cmd.FormGroup]
    assert not of(cmd.ReleaseReplicas, out)

    d, train = _async_driver()
    d.send(ev.WorkersLost(("tcp://c",)))
    out = d.send(ev.WorkersLost(("tcp://b",)))
    [record] = of(cmd.RecordFailure, out)
    assert record.update and record.record["lost"] == ["tcp://b", "tcp://c"]
    assert record.record["window_steps_lost"] > 0 and "kept_window" not in record.record
    [rollback] = of(cmd.RollBack, out)
    assert rollback.members == ("tcp://a",) and rollback.step == 2

    d, train = _async_driver()
    d.send(ev.WorkersLost(("tcp://c",)))
    error = ReplicaError("boom")
    out = d.send(ev.WindowFailed(0, 0, train.first_window, error, False))
    assert [type(c) for c in out][-3:] == [cmd.StopWindows, cmd.RollBack, cmd.FormGroup]
    assert of(cmd.RollBack, out)[0].step == 2 and d.state.status == "forming"


def test_async_with_two_servers_releases_only_replicas_that_host_no_shard():
    d, _ = _async_driver(servers=2)
    out = d.send(ev.WorkersLost(("tcp://b",)))  # replica 1 hosts shard 1
    assert not of(cmd.ReleaseReplicas, out) and of(cmd.RollBack, out)


def test_only_rendezvous_errors_form_the_group_again():
    """A group that failed to form is formed again only for errors of forming it (the
    engine's CollectiveError, torch.distributed's store and network errors); a model
    factory's own RuntimeError fails the fit at once instead of being retried."""
    import torch.distributed as dist

    from dataflow.core.errors import CollectiveError
    from dataflow.driver.loop import _is_rendezvous_error

    assert _is_rendezvous_error(CollectiveError("replica 1 could not join"))
    assert _is_rendezvous_error(dist.DistNetworkError("connection refused"))
    assert _is_rendezvous_error(dist.DistStoreError("timed out"))
    assert not _is_rendezvous_error(RuntimeError("no weights file on this node"))
    assert not _is_rendezvous_error(ValueError("bad"))


def test_every_event_and_command_type_has_a_handler():
    """Dispatch is exhaustive: the ``Event`` and ``Command`` unions hold every event and
    command class their modules define, the machine has a handler for each event, and
    the loop's table (built at import) one for each command."""
    import dataclasses
    import inspect
    import typing

    from dataflow.driver.loop import COMMAND_HANDLERS
    from dataflow.driver.transitions import TRANSITIONS

    def defined(module) -> set:
        return {
            c
            for _, c in inspect.getmembers(module, inspect.isclass)
            if c.__module__ == module.__name__ and dataclasses.is_dataclass(c)
        }

    assert set(typing.get_args(ev.Event)) == defined(ev)
    assert set(typing.get_args(cmd.Command)) == defined(cmd)
    handled = {t for rules in TRANSITIONS.values() for t, r in rules.items() if isinstance(r, str)}
    assert handled == set(typing.get_args(ev.Event)) - {ev.Timer}  # a poll decides nothing
    assert set(COMMAND_HANDLERS) == set(typing.get_args(cmd.Command))


def test_no_exception_steers_the_loop_a_loss_reaches_it_as_an_event():
    """The loop catches no exception to change its course: only the executor knows its
    internal ``Lost`` signal, and turns it into a queued WorkersLost event
    (``Executor.carry_out``). Read from the source: the loop neither imports ``Lost``
    nor has a handler for any exception but the rendezvous errors it reports as
    GroupFailed events."""
    import ast
    import inspect

    from dataflow.driver import loop

    tree = ast.parse(inspect.getsource(loop))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "Lost" not in imported
    caught = [
        ast.unparse(h.type) for n in ast.walk(tree) if isinstance(n, ast.Try) for h in n.handlers
    ]
    assert not any("Lost" in c for c in caught), caught


def test_the_log_is_a_ring_bounded_by_the_results_it_holds():
    from dataflow.driver.log import DriverLog

    log = DriverLog(config=None, limit=10)
    for window in range(4):  # 1 + 3 results each: at most 2 fit in 10
        log.record(ev.WindowDone(0, window, {r: None for r in range(3)}), [])
    assert [e.window for e in log.events] == [2, 3] and log.dropped == 2
    log.record(ev.WorkersLost(("tcp://a",)), [cmd.ChoosePhase()])
    assert len(log) == 3 and log.commands == [cmd.ChoosePhase()]


def test_the_machine_keeps_the_fits_position_and_ends_it_when_every_epoch_is_trained():
    """The position (next epoch, first step, the phase before) is machine state: the
    schedule is asked for a phase from it, and the end of training is the machine's
    decision, not the planner's answer."""
    d = Driver(epochs=PHASE0.end_epoch)
    _, calibration = d.start()
    [train] = of(cmd.SubmitWindows, d.finish_plan(calibration))
    d.finish_plan(train)
    out = d.send(ev.PhaseEnded(0, ({"weights_digest": "x"},) * 2))
    assert [type(c) for c in out] == [cmd.RecordPhase, cmd.Finish]
    assert (d.state.epoch, d.state.next_step, d.state.previous) == (2, 8, PHASE0)
    assert d.state.status == "done"

    resumed = Driver(epochs=3)  # a resume from the checkpoint after PHASE0
    resumed.send(ev.Started(tuple(W[:2]), restore=True, epoch=2, step=8, previous=PHASE0))
    assert resumed.send(ev.GroupFormed(0)) == [cmd.ChoosePhase(2, PHASE0)]
    phase1 = PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=16)
    assert resumed.send(ev.PhaseChosen(phase1)) == [cmd.PlanSegment("phase", 2, phase1, 8)]


# scale_with_batch without a cost model: ceil(batch / 8) workers, at most 4
SCALING = WorkerScaling(max_workers=4, max_micro_batch=8, timeout_s=30.0)


def after_phase0(batch: int, pool: tuple[str, ...] = ()) -> tuple[Driver, PhaseSpec]:
    """A scale_with_batch fit on W[:2] (``pool`` waiting) after PHASE0, and its next
    phase of ``batch`` samples a step."""
    d = Driver(scaling=SCALING, epochs=3)
    d.send(ev.Started(tuple(W[:2]), epoch=2, step=8, previous=PHASE0))
    d.send(ev.GroupFormed(0))
    if pool:
        d.send(ev.WorkersJoined(pool))
    return d, PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=batch)


def test_scale_with_batch_asks_the_cluster_for_what_the_batch_wants_once_and_takes_joiners():
    d = Driver(scaling=SCALING)
    assert d.send(ev.Started(tuple(W[:2]))) and d.send(ev.GroupFormed(0)) == [cmd.ChoosePhase()]
    assert of(cmd.ScaleCluster, d.send(ev.PhaseChosen(PHASE0))) == []  # the first: as is
    d2, phase1 = after_phase0(24)  # 3 workers wanted, 2 in the fit: the machine asks
    why = WorkersWanted(3, "max_micro_batch")
    assert d2.send(ev.PhaseChosen(phase1)) == [cmd.ScaleCluster(phase1, 3, 30.0, why)]
    d2.send(ev.WorkersJoined((W[2],)))  # the worker the cluster started
    [form] = d2.send(ev.PhaseChosen(phase1))  # said again once scaled: not asked twice
    assert isinstance(form, cmd.FormGroup) and form.joining == (W[2],)


def test_scale_with_batch_asks_nothing_when_the_members_and_pool_are_enough():
    d, phase1 = after_phase0(16)  # 2 wanted, 2 members: planned at once
    [plan] = d.send(ev.PhaseChosen(phase1))
    assert plan == cmd.PlanSegment(cmd.SegmentKind.PHASE, 2, phase1, 8)
    d, phase1 = after_phase0(24, pool=(W[2],))  # 3 wanted: 2 members and 1 in the pool
    [form] = d.send(ev.PhaseChosen(phase1))
    assert isinstance(form, cmd.FormGroup) and form.joining == (W[2],)
    assert of(cmd.ScaleCluster, d.out) == []


def test_the_root_cause_is_the_first_real_failure_not_its_echoes():
    from dataflow.core.errors import CollectiveError
    from dataflow.driver.root_cause import root_cause

    echo, real = CollectiveError("connection closed by peer"), ValueError("bad sample")
    # window 3 rank 0 echoes rank 1's real failure; a later window's real one loses
    assert root_cause([((3, 0), echo), ((3, 1), real), ((4, 0), KeyError("x"))]) == 1
    assert root_cause([((3, 1), echo), ((3, 0), echo)]) == 1  # only echoes: the earliest
    assert root_cause([((3, 0), None), ((2, 1), None)]) is None  # none readable
    # a parameter-store call failed with a peer's reason: that peer's error is the cause
    from dataflow.core.errors import NonFiniteError
    from dataflow.ps.shard import ShardError

    store_echo = ShardError("parameter store, replica 0: replica 1 failed in window 2: ...")
    assert root_cause([((2, 0), store_echo), ((2, 1), NonFiniteError("step 2"))]) == 1


def test_only_an_error_that_may_echo_a_lost_peer_waits_for_the_schedulers_word():
    """The driver waits FAILURE_GRACE_S after a failed window only when the error may be
    a survivor's view of a dead peer; its own errors are reported (or rolled back) at
    once (a non-finite step's rollback used to wait the full grace)."""
    import torch

    from dataflow.core.errors import CollectiveError, DataError, NonFiniteError
    from dataflow.driver.root_cause import may_echo_a_loss
    from dataflow.ps.shard import ShardError

    gloo = RuntimeError("Connection closed by peer [127.0.0.1]:29871")
    timeout = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out"
    )
    store = ShardError("parameter store, replica 0: replica 1 failed in window 2: ...")
    echoes = (CollectiveError("aborted"), gloo, timeout, store, ConnectionResetError())
    for echo in (*echoes, TimeoutError(), None):
        assert may_echo_a_loss(echo), echo
    # a model's mistakes are RuntimeErrors too, but no peer's: reported at once
    shapes = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x64 and 32x3)")
    dtypes = RuntimeError("Input type (unsigned char) and bias type (float) should be the same")
    own = (NonFiniteError("step 7"), DataError("label 7"), ValueError(), IndexError(), KeyError())
    for error in (*own, shapes, dtypes, RuntimeError("disk on fire"), torch.OutOfMemoryError()):
        assert not may_echo_a_loss(error), error
