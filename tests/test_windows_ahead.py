"""The driver queues a plan's windows at most ``WINDOWS_AHEAD`` past its commit, and a
replica keeps that many commits: whatever window results a lost worker takes with it,
the commit the survivors roll back to is one they hold. (Before, every window of a
plan was queued at once: a driver slow to gather, on a loaded machine, let the
replicas run past the commits they kept, and the rollback failed.)

Pure machine tests, in milliseconds; test_spatial_recovery.py and test_lost_worker.py
kill a worker of a real cluster behind a driver that lags."""

from __future__ import annotations

import pytest
from test_driver_machine import Driver, W, of, result

import dataflow as dfl
from dataflow.core.window import WINDOWS_AHEAD
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev


def _queued(submits: list) -> list[int]:
    """The fit-wide windows the SubmitWindows commands queue, in order."""
    return [c.first_window + w.index for c in submits for w in c.queued_windows()]


def _done(d: Driver, submit: cmd.SubmitWindows, window: int, ranks=(0, 1)) -> list:
    """Fit window ``window`` (of ``submit``'s plan) finished on ``ranks``."""
    plan_window = submit.plan.windows[window - submit.first_window]
    out = []
    for r in ranks:
        out += d.send(
            ev.WindowDone(submit.generation, window, {r: result(r, submit.plan, plan_window)})
        )
    return out


def test_a_plan_is_queued_two_windows_past_the_commit_and_one_more_per_commit():
    d = Driver(window_steps=1)  # 8 steps: 8 windows of 1 step
    [_, submit] = d.start()
    assert len(submit.plan.windows) == 8 and WINDOWS_AHEAD == 2
    assert _queued([submit]) == [0, 1]
    assert d.state.queued_until == 2
    # window 1 finishes first everywhere: nothing commits, nothing more is queued
    assert _done(d, submit, 1) == []
    # window 0's first result only: still nothing (the driver lags the replicas)
    assert _done(d, submit, 0, ranks=(0,)) == []
    # its last result: windows 0 and 1 commit, and windows 2 and 3 are queued
    out = _done(d, submit, 0, ranks=(1,))
    assert len(of(cmd.CommitWindow, out)) == 2 and _queued(of(cmd.SubmitWindows, out)) == [2, 3]
    seen = [0, 1, 2, 3]
    for window in range(2, 8):  # then one window per commit, to the plan's end
        out = _done(d, submit, window)
        assert len(of(cmd.CommitWindow, out)) == 1
        more = _queued(of(cmd.SubmitWindows, out))
        seen += more
        assert more == ([window + 2] if window + 2 < 8 else [])
        assert d.state.queued_until - d.state.commit_window <= WINDOWS_AHEAD
    assert seen == list(range(8))
    assert of(cmd.EndPhase, out)  # the phase ends once its last window commits


def test_checkpoint_and_best_marks_go_with_the_windows_queued_later():
    d = Driver(window_steps=1, checkpoint_every=3, checkpoints=True)
    [_, submit] = d.start()
    marked = set(submit.checkpoints)
    assert marked and max(marked) >= WINDOWS_AHEAD  # some marks fall on later windows
    later = []
    for window in range(8):
        later += of(cmd.SubmitWindows, _done(d, submit, window))
    for c in later:  # each later command names the same marks for the windows it queues
        for w in c.queued_windows():
            assert (w.index in c.checkpoints) == (w.index in marked)


def test_a_lost_worker_rolls_the_survivors_back_no_further_than_the_commits_they_keep():
    """Three replicas, windows of one step; window 0 is done on two replicas, window 1
    on one, when replica 2's worker dies. A survivor committed the start of each window
    it ran, of windows before ``queued_until``, and keeps the last ``WINDOWS_AHEAD``:
    the rollback is to one of those, or to the end of the last (nothing to restore)."""
    d = Driver(window_steps=1)
    [_, submit] = d.start(workers=W[:3])
    _done(d, submit, 0, ranks=(0, 1))
    _done(d, submit, 1, ranks=(0,))
    queued = d.state.queued_until
    out = d.send(ev.WorkersLost((W[2],)))
    [rollback] = of(cmd.RollBack, out)
    held = range(queued - WINDOWS_AHEAD, queued + 1)  # window w starts at step w
    assert rollback.step in held and rollback.step == 1  # window 0 salvaged, 1 not


@pytest.mark.parametrize("windows", [1, 2, 5])
def test_plans_of_any_length_queue_every_window_once(windows):
    d = Driver(window_steps=8 // windows if 8 % windows == 0 else 1)
    [_, submit] = d.start()
    queued = _queued([submit])
    for window in range(len(submit.plan.windows)):
        queued += _queued(of(cmd.SubmitWindows, _done(d, submit, window)))
    assert queued == list(range(len(submit.plan.windows)))


def test_a_result_for_a_window_never_queued_is_ignored():
    """Only a queued window can have run: a result naming a later one (a stale or
    confused report) is not kept, and commits nothing."""
    d = Driver(window_steps=1)
    [_, submit] = d.start()
    assert _done(d, submit, 3) == [] and 3 not in d.state.pending
    _done(d, submit, 0)
    _done(d, submit, 1)
    assert d.state.commit_window == 2  # window 3 was not committed out of nothing


@pytest.mark.parametrize(
    "sync", [dfl.sync.Async(staleness=2), dfl.sync.Local(period_steps=1)], ids=["async", "local"]
)
def test_a_loss_after_every_queued_window_finished_regroups_rather_than_release_one_never_queued(
    sync,
):
    """Under Async and Local the survivors of a loss finish the window in flight without
    the lost replica (a release). When every queued window is done but the lost
    replica's results, those windows are salvaged and nothing is in flight: the next
    window was never queued, so no replica could finish it. The survivors regroup from
    the commit at once. (The fault soak found the machine releasing such a window.)"""
    d = Driver(window_steps=1, sync=sync)
    [_, submit] = d.start(workers=W[:3])
    for window in (0, 1):
        _done(d, submit, window, ranks=(0, 1))  # replica 2's results lost with it
    out = d.send(ev.WorkersLost((W[2],)))
    assert len(of(cmd.CommitWindow, out)) == 2  # windows 0 and 1 salvaged
    assert not of(cmd.ReleaseReplicas, out)
    [rollback] = of(cmd.RollBack, out)
    assert rollback.step == 2 and rollback.members == W[:2]
    [record] = [c.record for c in of(cmd.RecordFailure, out)]  # nothing was rolled back
    assert record["kept_window"] and record["window_steps_lost"] == 0, record
    assert record["commit_step"] == 2 and record["retrained_parts"] == 0, record
