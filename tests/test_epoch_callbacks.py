"""``fit(on_epoch=...)``: the user's functions called after each epoch, live, and
``StopTraining`` ending the fit at that epoch's end.

The rule (``EarlyStopping``) and the machine's decision are pure (milliseconds); on a
real LocalCluster, a fit stopped after epoch 1 ends bit-identical to a fit of 2 epochs,
and a callback's mistake stops the fit naming the callback.
"""

import pytest
import torch
from conftest import held_out_pipeline, make_data, tiny_pipeline
from test_driver_machine import PHASE0, Driver, of, planned

import dataflow as dfl
from dataflow.callbacks import check_callbacks
from dataflow.core.phase import PhaseSpec
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.epoch_callbacks import EpochCallbacks
from dataflow.history.result import History

# -- the rule, pure ----------------------------------------------------------------------


def test_early_stopping_waits_patience_epochs_without_improvement():
    stop = dfl.EarlyStopping(metric="eval_loss", patience=3, min_delta=0.01)
    for epoch, loss in enumerate([1.0, 0.8, 0.795, 0.792]):  # not better by > 0.01
        stop({"epoch": epoch, "eval_loss": loss})
    assert (stop.best, stop.best_epoch, stop.waited) == (0.8, 1, 2)
    with pytest.raises(dfl.StopTraining, match=r"eval_loss has not improved on 0\.8 \(epoch 1\)"):
        stop({"epoch": 4, "eval_loss": 0.81})


def test_early_stopping_follows_the_metrics_direction_and_skips_unevaluated_epochs():
    accuracy = dfl.EarlyStopping(metric="eval_accuracy", patience=1)
    assert accuracy.mode == "max"
    accuracy({"epoch": 0, "eval_accuracy": 0.5})
    accuracy({"epoch": 1, "train_loss": 0.3})  # not evaluated: nothing counted
    accuracy({"epoch": 2, "eval_accuracy": 0.6})
    with pytest.raises(dfl.StopTraining):
        accuracy({"epoch": 3, "eval_accuracy": 0.59})
    nan = dfl.EarlyStopping(metric="train_loss", patience=2)
    nan({"epoch": 0, "train_loss": float("nan")})  # not finite: never the best
    nan({"epoch": 1, "train_loss": 2.0})
    assert nan.best == 2.0 and nan.waited == 0


def _history(losses) -> History:
    return History(epochs=[{"epoch": k, "eval_loss": v} for k, v in enumerate(losses)])


def _verdicts(stop, losses) -> list[bool]:
    """Whether ``stop`` asked to stop after each epoch of a fit with these losses."""
    verdicts = []
    for k in range(len(losses)):
        history = _history(losses[: k + 1])
        try:
            stop(history.epochs[k], history)
            verdicts.append(False)
        except dfl.StopTraining:
            verdicts.append(True)
    return verdicts


def test_early_stopping_reads_its_state_from_the_fits_history():
    """A resumed fit's new instance stops where the uninterrupted fit's stops (its
    earlier epochs are in the history it is given), and one instance passed to two fits
    judges the second on its own epochs, not on the first fit's best."""
    losses = [1.0, 0.9, 0.95, 0.97, 0.5]
    assert _verdicts(dfl.EarlyStopping(patience=2), losses) == [False, False, False, True, False]
    resumed = dfl.EarlyStopping(patience=2)  # a new process: epochs 0-2 ran before it
    with pytest.raises(dfl.StopTraining, match=r"0\.9 \(epoch 1\) for 2 epochs"):
        resumed({"epoch": 3, "eval_loss": 0.97}, _history(losses[:4]))
    swept = dfl.EarlyStopping(patience=2)
    assert _verdicts(swept, [0.1, 0.2, 0.3]) == [False, False, True]
    assert _verdicts(swept, losses) == [False, False, False, True, False]  # 0.1 forgotten
    by_hand = dfl.EarlyStopping(patience=2)  # no history: it counts what it is given
    by_hand({"epoch": 7, "eval_loss": 0.9})
    by_hand({"epoch": 8, "eval_loss": 0.95})
    assert (by_hand.best, by_hand.best_epoch, by_hand.waited) == (0.9, 7, 1)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: dfl.EarlyStopping(patience=0), "patience=0"),
        (lambda: dfl.EarlyStopping(mode="lowest"), "mode='lowest'"),
        (lambda: dfl.EarlyStopping(min_delta=-1), "min_delta=-1"),
        (lambda: dfl.EarlyStopping(metric=""), "name an epoch metric"),
    ],
)
def test_a_bad_early_stopping_is_named(make, says):
    with pytest.raises(dfl.ConfigError, match=says):
        make()


def test_callbacks_are_checked_before_the_fit():
    assert check_callbacks(None, {"train_loss"}) == ()
    assert len(check_callbacks(print, {"train_loss"})) == 1
    with pytest.raises(dfl.ConfigError, match="give a function of"):
        check_callbacks([print, 3], {"train_loss"})
    with pytest.raises(dfl.ConfigError, match=r"the fit's epochs will have \['train_loss'\]"):
        check_callbacks(dfl.EarlyStopping(), {"train_loss"})
    x, y = make_data(32)
    with pytest.raises(dfl.ConfigError, match="eval_loss"):  # no eval_source: no eval_loss
        tiny_pipeline(x, y).fit(2, client=object(), on_epoch=dfl.EarlyStopping())


def test_each_epoch_is_reported_once_and_its_verdict_becomes_an_event():
    seen = []

    def stop_after_one(epoch, history):
        seen.append(epoch["epoch"])
        if epoch["epoch"] == 1:
            raise dfl.StopTraining("enough")

    history = History(epochs=[{"epoch": 0, "train_loss": 1.0}])
    hooks = EpochCallbacks([stop_after_one], reported=-1)
    assert hooks.after_commit(history, history.epochs) == [ev.EpochReviewed(0, None)]
    history.epochs.append({"epoch": 1, "train_loss": 0.5})
    assert hooks.after_commit(history, history.epochs[1:]) == [ev.EpochReviewed(1, "enough")]
    assert history.info["stopped_early"] == {"after_epoch": 1, "reason": "enough"}
    # trained again after a restart: not called again, the same verdict sent again
    assert hooks.after_commit(history, history.epochs) == [
        ev.EpochReviewed(0, None),
        ev.EpochReviewed(1, "enough"),
    ]
    assert seen == [0, 1]
    assert EpochCallbacks([]).after_commit(history, history.epochs) == []  # no callbacks

    def broken(epoch, history):
        raise KeyError("eval_acc")

    [refused] = EpochCallbacks([broken]).after_commit(history, history.epochs)
    assert isinstance(refused, ev.CommitRefused)
    assert isinstance(refused.error, dfl.CallbackError)
    assert "broken() raised KeyError" in str(refused.error)
    assert isinstance(refused.error.__cause__, KeyError)

    def quiet_stop(epoch, history):
        raise dfl.StopTraining

    [asked] = EpochCallbacks([quiet_stop]).after_commit(History(), history.epochs[:1])
    assert asked == ev.EpochReviewed(0, "quiet_stop() raised StopTraining")


PHASE_OF_4 = PhaseSpec(index=0, start_epoch=0, end_epoch=4, global_batch=8)  # 4 x 4 steps


def test_with_callbacks_no_step_past_an_epoch_is_planned_before_its_review():
    """Plans end at epoch ends and the next waits for the epoch's verdict: train on, or
    end the phase there (the phase as trained: its epochs and steps cut at the stop),
    record it, write its checkpoint, and finish. A verdict not awaited (the phase's last
    epoch, a late one) changes nothing then."""
    d = Driver(checkpoints=True, epochs=8, epoch_review=True)
    _, submit = d.start(phase=PHASE_OF_4)
    out = d.finish_plan(submit)  # the 2 calibration steps
    [train] = of(cmd.SubmitWindows, out)
    assert [s.epoch for s in train.plan.steps] == [0, 0]  # the rest of epoch 0 only
    assert of(cmd.SubmitWindows, d.finish_plan(train)) == []  # waits for the review
    assert d.state.reviewing == 0
    assert d.send(ev.EpochReviewed(3, None)) == []  # not the one awaited
    [epoch1] = d.send(ev.EpochReviewed(0, None))
    assert {s.epoch for s in epoch1.plan.steps} == {1}
    d.finish_plan(epoch1)
    [ending] = d.send(ev.EpochReviewed(1, "enough"))
    assert ending == cmd.EndPhase(0, d.machine.members)
    assert d.state.phase.end_epoch == 2 and len(d.state.phase_steps) == 8
    out = d.send(ev.PhaseEnded(0, ({"weights_digest": "x"}, {"weights_digest": "x"})))
    assert [type(c) for c in out] == [cmd.RecordPhase, cmd.WriteCheckpoint, cmd.Finish]
    assert out[0].phase.end_epoch == 2 and len(out[0].phase_steps) == 8
    assert out[1].step == 8

    d = Driver(epochs=4, epoch_review=True)  # a phase of one epoch: its end is the boundary
    one = PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=8)
    _, submit = d.start(phase=one)
    d.finish_plan(of(cmd.SubmitWindows, d.finish_plan(submit))[0])
    out = d.send(ev.EpochReviewed(0, "late"))  # while the phase ends: kept for the boundary
    assert out == [] and d.state.stop_asked == 0
    out = d.send(ev.PhaseEnded(0, ({"weights_digest": "x"}, {"weights_digest": "x"})))
    assert [type(c) for c in out] == [cmd.RecordPhase, cmd.Finish]
    assert PHASE0.end_epoch == 2


def test_a_loss_while_a_review_is_awaited_recovers_and_the_stop_waits_for_the_next_epoch():
    """Worker b lost after epoch 0's windows committed, before their verdict: the
    survivor regroups and plans the rest (the review is no longer awaited); the late
    verdict's stop is kept and ends the fit at the next epoch end awaited."""
    d = Driver(epochs=8, epoch_review=True)
    _, submit = d.start(phase=PHASE_OF_4)
    d.finish_plan(of(cmd.SubmitWindows, d.finish_plan(submit))[0])
    assert d.state.reviewing == 0
    out = d.send(ev.WorkersLost(("tcp://b",)))
    [form] = of(cmd.FormGroup, out)
    assert d.state.committed_step == 4  # nothing rolled back: epoch 0 committed
    [plan_rest] = d.send(ev.GroupFormed(form.generation))
    rest = tuple(s for s in planned(PHASE_OF_4, 1) if s.index >= 4)  # on the survivor
    _, epoch1 = d.send(ev.SegmentPlanned(PHASE_OF_4, d.state.phase_steps, rest, continued=True))
    assert d.state.reviewing is None and isinstance(plan_rest, cmd.PlanSegment)
    assert d.send(ev.EpochReviewed(0, "enough")) == []  # late: kept, not acted on
    assert {s.epoch for s in epoch1.plan.steps} == {1}
    d.finish_plan(epoch1)
    assert d.state.reviewing == 1
    assert d.send(ev.EpochReviewed(1, None)) == [cmd.EndPhase(form.generation, ("tcp://a",))]
    assert d.state.phase.end_epoch == 2


# -- on a cluster ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync",
    [None, dfl.sync.Local(period_steps=2), dfl.sync.Async(staleness=0)],
    ids=["synchronous", "local", "async"],
)
def test_a_fit_stopped_after_an_epoch_equals_a_fit_of_that_many_epochs(client, tmp_path, sync):
    """One phase of 6 epochs: the callback sees each epoch live with its held-out metrics,
    asks to stop after epoch 1, and the fit ends there: the same weights as a fit of 2
    epochs, under each sync policy; its checkpoint the last, and resuming it trains on."""
    x, y = make_data(160)

    def pipe():
        return held_out_pipeline(x, y, **({} if sync is None else {"sync": sync}))

    seen = []

    def watch(epoch, history):
        seen.append((epoch["epoch"], round(epoch["eval_loss"], 9), len(history.epochs)))
        if epoch["epoch"] == 1:
            raise dfl.StopTraining("seen enough")

    stopped = pipe().fit(6, client=client, on_epoch=watch, checkpoint_dir=tmp_path)
    assert [e["epoch"] for e in stopped.history.epochs] == [0, 1]
    [phase] = stopped.history.phases  # the phase as trained: cut at the stop
    assert (phase["start_epoch"], phase["end_epoch"], phase["steps"]) == (0, 2, 16)
    assert [(e, n) for e, _, n in seen] == [(0, 1), (1, 2)]
    assert [loss for _, loss, _ in seen] == [
        round(e["eval_loss"], 9) for e in stopped.history.epochs
    ]
    assert stopped.history.info["stopped_early"] == {"after_epoch": 1, "reason": "seen enough"}
    summary = stopped.summary()
    assert "trained 2 of 6 epoch(s)" in summary
    assert "stopped early after epoch 1: seen enough" in summary
    two = pipe().fit(2, client=client)
    for name, tensor in two.model.state_dict().items():
        assert torch.equal(stopped.model.state_dict()[name], tensor), name
    if sync is not None:
        return
    # the same command again (a requeued job): that fit has ended, nothing trains
    again = pipe().fit(6, on_epoch=watch, checkpoint_dir=tmp_path, resume=True)
    assert again.history.info["already_finished"]["epoch"] == 2
    assert "stopped early after epoch 1: seen enough" in again.summary()
    assert len(seen) == 2  # no callback called again
    for name, tensor in stopped.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name
    resumed = pipe().fit(3, client=client, checkpoint_dir=tmp_path, resume=True)
    assert [e["epoch"] for e in resumed.history.epochs] == [0, 1, 2]
    assert "stopped_early" not in resumed.history.info


@pytest.mark.slow
def test_a_resumed_fit_with_a_new_early_stopping_stops_where_the_uninterrupted_one_does(
    client, tmp_path
):
    """Random labels: the held-out loss is lowest after epoch 0 and rises, so patience 2
    stops the uninterrupted fit after epoch 2. A fit of 1 epoch, then resumed in a new
    instance (as a new process after a preemption), stops there too: its EarlyStopping
    counts epoch 0 from the history, where it used to start afresh at epoch 1 and stop
    after epoch 3."""
    from test_keep_best import BatchNormCNN

    x, y = make_data(160)

    def pipe():
        return held_out_pipeline(x, y, model=BatchNormCNN)

    def patience_2():
        return dfl.EarlyStopping(metric="eval_loss", patience=2)

    whole = pipe().fit(8, client=client, on_epoch=patience_2())
    stop = whole.history.info["stopped_early"]
    assert stop["after_epoch"] == 2 and "(epoch 0)" in stop["reason"], stop
    pipe().fit(1, client=client, on_epoch=patience_2(), checkpoint_dir=tmp_path)
    resumed = pipe().fit(
        8, client=client, on_epoch=patience_2(), checkpoint_dir=tmp_path, resume=True
    )
    assert [e["epoch"] for e in resumed.history.epochs] == [0, 1, 2]
    assert resumed.history.info["stopped_early"]["after_epoch"] == 2


@pytest.mark.slow
def test_a_callbacks_mistake_stops_the_fit_naming_it(client):
    x, y = make_data(64)

    def log_accuracy(epoch, history):
        print(epoch["eval_accuracy"])  # the fit does not evaluate: a KeyError

    with pytest.raises(dfl.CallbackError, match=r"log_accuracy\(\) raised KeyError") as caught:
        tiny_pipeline(x, y).fit(3, client=client, on_epoch=[log_accuracy])
    assert isinstance(caught.value.__cause__, KeyError)
