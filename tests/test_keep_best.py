"""``fit(keep_best=...)``: the weights of the epoch with the best metric.

The rule and the checks before the fit, which windows bring the replicas' states back
(machine scripts), the weights a phase end would hold from those states, the file and
its resume, in milliseconds; then on a LocalCluster, under each sync policy, the kept
weights equal those of a fit that ended at the best epoch.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, held_out_pipeline, make_data, sgd, tiny_pipeline
from test_driver_machine import Driver, of

import dataflow as dfl
from dataflow import stages
from dataflow.callbacks import KeepBest, as_keep_best
from dataflow.checkpoint import CheckpointStore
from dataflow.checkpoint.best import best_record, load_best
from dataflow.core.phase import PhaseSpec
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.best_weights import BestWeights, synchronized_weights
from dataflow.errors import ConfigError
from dataflow.runtime.replica_spec import ReplicaState

# -- the rule ------------------------------------------------------------------------


def test_keep_best_follows_the_metrics_direction_and_never_keeps_a_non_finite_value():
    loss, accuracy = KeepBest("eval_loss"), KeepBest("eval_accuracy", min_delta=0.01)
    assert (loss.mode, accuracy.mode) == ("min", "max")
    assert loss.improves(0.5, None) and loss.improves(0.4, 0.5) and not loss.improves(0.5, 0.5)
    assert not loss.improves(float("nan"), None) and not loss.improves(float("inf"), 1.0)
    assert accuracy.improves(0.92, 0.9) and not accuracy.improves(0.905, 0.9)
    assert KeepBest("eval_loss", mode="max").improves(0.6, 0.5)


@pytest.mark.parametrize(
    ("keep_best", "says"),
    [
        ("eval_accuracy", r"KeepBest\(metric='eval_accuracy'\): the fit's epochs will have"),
        (3, r"fit\(keep_best=3\): name an epoch metric"),
    ],
)
def test_a_keep_best_no_epoch_can_satisfy_is_refused_before_the_fit(keep_best, says):
    with pytest.raises(dfl.ConfigError, match=says):
        as_keep_best(keep_best, {"train_loss", "eval_loss"})
    x, y = make_data(32)
    with pytest.raises(dfl.ConfigError, match=says):
        tiny_pipeline(x, y).fit(1, keep_best=keep_best)  # before any cluster starts


def test_a_misspelt_metric_is_answered_with_the_closest_name():
    with pytest.raises(dfl.ConfigError, match=r"did you mean 'eval_accuracy'\?"):
        as_keep_best("eval_acc", {"train_loss", "eval_loss", "eval_accuracy"})
    with pytest.raises(dfl.ConfigError, match=r"did you mean 'eval_accuracy'\?"):
        dfl.callbacks.check_callbacks(
            dfl.EarlyStopping(metric="eval_acuracy"), {"train_loss", "eval_accuracy"}
        )


def test_a_bad_keep_best_is_named_where_it_is_built():
    with pytest.raises(dfl.ConfigError, match=r"KeepBest\(mode='up'\): use 'min', 'max'"):
        KeepBest("train_loss", mode="up")
    with pytest.raises(dfl.ConfigError, match=r"KeepBest\(min_delta=-1\)"):
        KeepBest("train_loss", min_delta=-1)
    with pytest.raises(dfl.ConfigError, match=r"KeepBest\(metric=''\)"):
        KeepBest("")


def test_the_metrics_cadence_is_its_evaluations():
    x, y = make_data(64)
    held_out = dfl.io.ArraySource(x[:16], y[:16], shuffle=False)
    trainer = tiny_pipeline(x, y, eval_source=held_out, eval_every=3).trainer
    assert trainer.metric_every("eval_loss") == 3 and trainer.metric_every("train_loss") == 1


# -- which windows bring the states back (machine scripts) ----------------------------


PHASE_OF_4 = PhaseSpec(index=0, start_epoch=0, end_epoch=4, global_batch=8)  # 4 x 4 steps


def run_phase(d: Driver, phase: PhaseSpec) -> list:
    """Every planned window done, the plans as they come, until the phase ends."""
    begin_and_submit = d.start(phase=phase)
    out, todo = [], of(cmd.SubmitWindows, begin_and_submit)
    while todo:
        done = d.finish_plan(todo.pop())
        out += done
        todo += of(cmd.SubmitWindows, done)
    return out


@pytest.mark.parametrize("every", [1, 2])
def test_the_states_come_back_at_each_measured_epochs_end_and_are_offered_after_its_commit(
    every,
):
    d = Driver(epochs=4, best_every=every)
    out = run_phase(d, PHASE_OF_4)
    commits = [c for c in out if isinstance(c, cmd.CommitWindow | cmd.KeepIfBest)]
    offered = of(cmd.KeepIfBest, out)
    measured = [e for e in range(4) if (e + 1) % every == 0]
    assert [(k.epoch, k.step) for k in offered] == [(e, 4 * (e + 1)) for e in measured]
    for k in offered:  # right after the commit of the window that ends its epoch
        before = commits[commits.index(k) - 1]
        last = before.plan.steps[before.window.stop - 1]
        assert isinstance(before, cmd.CommitWindow) and last.last_in_epoch
        assert last.epoch == k.epoch and k.states == ({"r": 0}, {"r": 1})
    for c in of(cmd.CommitWindow, out):  # a window never spans an epoch's end
        assert len({s.epoch for s in c.plan.steps[c.window.first : c.window.stop]}) == 1
    assert isinstance(out[-1], cmd.EndPhase)


def test_without_keep_best_no_state_comes_back_and_a_checkpoint_mark_is_its_own():
    d = Driver(epochs=4)
    out = run_phase(d, PHASE_OF_4)
    assert of(cmd.KeepIfBest, out) == [] and of(cmd.WriteCheckpoint, out) == []
    d = Driver(epochs=4, best_every=4, checkpoints=True, checkpoint_every=2)
    out = run_phase(d, PHASE_OF_4)
    [offered] = of(cmd.KeepIfBest, out)
    assert offered.epoch == 3
    # the phase's last window is left to the boundary checkpoint, not the best's
    assert all(w.step < 16 for w in of(cmd.WriteCheckpoint, out))


def test_an_epoch_a_lost_replica_left_without_its_state_is_not_offered():
    d = Driver(epochs=4, best_every=1)
    _, submit = d.start(phase=PHASE_OF_4)
    [train] = of(cmd.SubmitWindows, d.finish_plan(submit))
    d.finish_plan(train, ranks=[0])  # replica 1 lost after its windows, results unseen
    out = d.send(ev.WorkersLost(("tcp://b",)))
    # the windows replica 0 finished commit (salvaged), each epoch's end among them, but
    # replica 1's state at those ends never came: no epoch is offered. (Two windows: with
    # none committed, no more were queued; results for the others are not taken.)
    ends = [c.plan.steps[c.window.stop - 1] for c in of(cmd.CommitWindow, out)]
    assert [(s.index, s.last_in_epoch) for s in ends] == [(3, True), (7, True)]
    assert of(cmd.KeepIfBest, out) == [] and d.state.committed_step == 8


# -- the weights a phase end would hold -----------------------------------------------


def bn_state(rank: int, *, weights: bool) -> ReplicaState:
    mean = torch.tensor([1.0, 2.0]) * (rank + 1)
    count = torch.tensor(5 + rank)
    model = {"w": torch.full((2,), 7.0), "bn.running_mean": mean, "bn.num_batches_tracked": count}
    return ReplicaState(
        model=model if weights else None,
        buffers={"bn.running_mean": mean, "bn.num_batches_tracked": count},
    )


def test_the_kept_weights_are_rank_0s_with_the_replicas_mean_float_buffers():
    states = (bn_state(0, weights=True), bn_state(1, weights=False), bn_state(2, weights=False))
    kept = synchronized_weights(states)
    assert torch.equal(kept["w"], torch.full((2,), 7.0))
    assert torch.equal(kept["bn.running_mean"], torch.tensor([2.0, 4.0]))  # (1 + 2 + 3) / 3
    assert int(kept["bn.num_batches_tracked"]) == 5  # an integer buffer: rank 0's
    assert torch.equal(states[1].buffers["bn.running_mean"], torch.tensor([2.0, 4.0]))
    # a spatial layout: a tuple of the group's workers per replica, the first one's buffers
    grouped = (
        (bn_state(0, weights=True), bn_state(9, weights=False)),
        (bn_state(1, weights=False),) * 2,
    )
    assert torch.equal(synchronized_weights(grouped)["bn.running_mean"], torch.tensor([1.5, 3.0]))


# -- the file, and a resumed fit's bar ------------------------------------------------


FINGERPRINT = {"model": {}, "data": {"num_samples": 64}, "config": {"seed": 0}}


def offer(best: BestWeights, epoch: int, value: float, scored: int | None = None) -> bool:
    record = {"epoch": epoch, "train_loss": 1.0, "eval_loss": value}
    if scored is not None:
        record["held_out_samples"] = scored
    states = (ReplicaState(model={"w": torch.full((1,), float(epoch))}, buffers={}),)
    return best.offer(record, 10 * (epoch + 1), states)


def test_a_better_epoch_replaces_the_kept_one_on_disk_and_a_resumed_fit_must_beat_it(tmp_path):
    store = CheckpointStore(tmp_path)
    best = BestWeights(KeepBest("eval_loss"), store, FINGERPRINT, held_out=64)
    assert [
        offer(best, 0, 0.9),
        offer(best, 1, 0.7),
        offer(best, 2, 0.8),
        offer(best, 3, float("nan")),
        offer(best, 4, 0.1, scored=32),  # a lost worker's share unscored: no candidate
    ] == [True, True, False, False, False]
    assert best.info() == {
        "metric": "eval_loss",
        "mode": "min",
        "epoch": 1,
        "step": 20,
        "value": 0.7,
        "path": str(tmp_path / "best.pt"),
    }
    saved = load_best(tmp_path)
    assert torch.equal(saved["model_state"]["w"], torch.full((1,), 1.0))
    assert (saved["epoch"], saved["step"], saved["value"]) == (1, 20, 0.7)

    again = BestWeights(KeepBest("eval_loss"), CheckpointStore(tmp_path), FINGERPRINT)
    again.resume()
    assert again.info()["epoch"] == 1 and torch.equal(again.weights()["w"], torch.ones(1))
    assert not offer(again, 2, 0.75) and offer(again, 3, 0.6)
    other_rule = BestWeights(KeepBest("eval_loss", mode="max"), store, FINGERPRINT)
    other_rule.resume()
    assert other_rule.info() is None  # the file another rule chose is no bar
    other_fit = BestWeights(KeepBest("eval_loss"), store, {**FINGERPRINT, "config": {"seed": 1}})
    other_fit.resume()
    assert other_fit.info() is None


def test_a_damaged_best_file_is_named_and_a_fresh_fit_clears_it(tmp_path):
    store = CheckpointStore(tmp_path)
    with pytest.raises(dfl.errors.CheckpointError, match="no best weights in"):
        load_best(tmp_path)
    best = BestWeights(KeepBest("eval_loss"), store, FINGERPRINT)
    offer(best, 0, 0.5)
    with open(tmp_path / "best.pt", "r+b") as file:
        file.seek(40)
        file.write(b"\0" * 8)
    with pytest.raises(dfl.errors.CheckpointError, match=r"best.pt is corrupt.*it is not used"):
        load_best(tmp_path)
    with pytest.warns(RuntimeWarning, match="ignoring the best weights"):
        assert best_record(store, FINGERPRINT) is None
    manifest = json.loads((tmp_path / "best.json").read_text())
    assert manifest["metric"] == "eval_loss" and manifest["epoch"] == 0
    store.clear()
    assert not (tmp_path / "best.pt").exists() and not (tmp_path / "best.json").exists()


# -- on a cluster ---------------------------------------------------------------------


class BatchNormCNN(torch.nn.Module):
    """BatchNorm's running statistics drift apart between replicas inside a phase: the
    kept weights must hold their mean, as a phase end does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync",
    [None, dfl.sync.Local(period_steps=2), dfl.sync.Async(staleness=0)],
    ids=["synchronous", "local", "async"],
)
def test_the_kept_weights_equal_a_fit_that_ended_at_the_best_epoch(client, tmp_path, sync):
    """Each epoch evaluated, the lowest held-out loss kept. The labels are random, so the
    model overfits: the held-out loss rises after the first epochs, and the kept weights
    are not the final ones. They equal, bit for bit, the weights of a fit of that many
    epochs, BatchNorm statistics included; an EarlyStopping on the same metric ends the
    fit on the way, and the file in the checkpoint folder holds the same weights."""
    x, y = make_data(160)

    def pipe():
        sync_option = {} if sync is None else {"sync": sync}
        return held_out_pipeline(x, y, model=BatchNormCNN, optimizer=sgd, **sync_option)

    stop = dfl.EarlyStopping(metric="eval_loss", patience=2)
    result = pipe().fit(
        6, client=client, keep_best="eval_loss", on_epoch=stop, checkpoint_dir=tmp_path
    )
    losses = [e["eval_loss"] for e in result.history.epochs]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert best < len(losses) - 1  # not the final weights
    assert len(losses) == best + 3  # the early stop: 2 epochs without a higher one
    info = result.history.info["best"]
    assert (info["epoch"], info["value"], info["mode"]) == (best, losses[best], "min")
    assert info["path"] == str(tmp_path / "best.pt")
    assert f"best eval_loss {losses[best]:.4g} after epoch {best}" in result.summary()
    shorter = pipe().fit(best + 1, client=client)
    kept = result.best_model.state_dict()
    for name, tensor in shorter.model.state_dict().items():
        assert torch.equal(kept[name], tensor), name
    on_disk = load_best(tmp_path)["model_state"]
    assert all(torch.equal(on_disk[name], tensor) for name, tensor in kept.items())
    assert not torch.equal(kept["head.weight"], result.model.state_dict()["head.weight"])


@pytest.mark.slow
def test_a_resumed_fit_keeps_the_best_of_its_earlier_runs_until_it_beats_it(client, tmp_path):
    """With a ``min_delta`` no epoch can beat, the first run keeps epoch 0; resumed to
    more epochs, the file is the bar, nothing beats it, and the resumed fit's best model
    is read back from it. Without a folder, the best is kept in memory."""
    x, y = make_data(160)

    def pipe():
        return held_out_pipeline(x, y)

    rule = dfl.KeepBest("eval_loss", min_delta=100.0)
    first = pipe().fit(2, client=client, keep_best=rule, checkpoint_dir=tmp_path)
    assert first.history.info["best"]["epoch"] == 0
    resumed = pipe().fit(4, client=client, keep_best=rule, checkpoint_dir=tmp_path, resume=True)
    assert [e["epoch"] for e in resumed.history.epochs] == [0, 1, 2, 3]
    assert resumed.history.info["best"] == first.history.info["best"]
    for name, tensor in first.best_model.state_dict().items():
        assert torch.equal(resumed.best_model.state_dict()[name], tensor), name
    # run again once finished (a requeued job): its result, the kept best model with it
    again = pipe().fit(4, client=client, keep_best=rule, checkpoint_dir=tmp_path, resume=True)
    assert again.history.info["already_finished"]["epoch"] == 4
    assert again.history.info["best"] == first.history.info["best"]
    for name, tensor in first.best_model.state_dict().items():
        assert torch.equal(again.best_model.state_dict()[name], tensor), name
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name
    with pytest.raises(ConfigError, match="already at epoch 4, past the 3 asked for"):
        pipe().fit(3, client=client, keep_best=rule, checkpoint_dir=tmp_path, resume=True)
    plain = pipe().fit(1, client=client, keep_best="train_loss")  # no folder: in memory
    assert plain.history.info["best"]["path"] is None and plain.best_model is not None
    assert pipe().fit(1, client=client).best_model is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_after_a_lost_worker_the_kept_weights_score_what_the_fit_recorded(tmp_path):
    """A worker SIGKILLed in epoch 1 of 4: the fit recovers on the others, and the kept
    weights are those of the epoch with the lowest held-out loss among all four;
    scored again (``evaluate``), they give the loss the fit recorded for it."""
    from distributed import Client, LocalCluster
    from test_lost_worker import KillOnce

    from dataflow.evaluation import evaluate

    x, y = make_data(240)
    held_out = dfl.io.ArraySource(x[192:], y[192:], shuffle=False)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x[:192], y[:192])))
    batch = g.add(KillOnce(str(tmp_path / "killed"), step=7, rank=1), batch)
    out = g.add(stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    update = g.add(stages.Update(sgd), g.add(stages.AllReduce(), g.add(stages.Backward(), out)))
    g.add(stages.Evaluate(held_out, metrics={"loss": torch.nn.functional.cross_entropy}), update)
    trainer = dfl.Trainer(
        g, schedule=dfl.schedule.Fixed(24), progress=False, window_seconds=0.3
    )  # 8 steps an epoch: the kill at step 7 ends epoch 0's last window
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        result = trainer.fit(4, client=client, keep_best="eval_loss")
    assert (tmp_path / "killed").exists() and result.history.info["failures"]
    losses = [e["eval_loss"] for e in result.history.epochs]
    best = result.history.info["best"]
    assert best["epoch"] == min(range(4), key=losses.__getitem__)
    scored = evaluate(result.best_model, held_out, metrics={"loss": F.cross_entropy})
    assert scored["loss"] == pytest.approx(best["value"], rel=1e-6)
