"""``ema_decay=``: a moving average of the weights, kept as training goes, equal to
``torch.optim.swa_utils.AveragedModel`` with an EMA updated after every step of a
one-process loop, under synchronous and local updates, through commits and rollbacks,
checkpoints and resumes; ``result.ema_model``.

The one-replica tests run the replica in this process (milliseconds); the ones marked
slow train on a real LocalCluster with real gloo collectives."""

import numpy as np
import pytest
import torch
from conftest import TinyCNN, in_process, make_data, max_abs_diff, sgd, tiny_pipeline
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dataflow as dfl
from dataflow.checkpoint import CheckpointStore
from dataflow.core.errors import ConfigError
from dataflow.stages.capture import WARMUP

DECAY = 0.8  # short enough that every step's weights still count at the end


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def averaged_reference(x, y, batches, *, optimizer=sgd, decay=DECAY, warmup=False, lrs=None):
    """The one-process loop with torch's own EMA, updated after each ``opt.step()``:
    the trained model and the average's state dict. ``warmup``: the decay after ``n``
    updates ``min(decay, (1 + n) / (10 + n))``, through ``AveragedModel``'s ``avg_fn``;
    ``lrs``: each step's LR, when a schedule changes it."""
    torch.manual_seed(0)
    model = TinyCNN()
    opt = optimizer(model.parameters())
    if warmup:

        def warmed(average, weights, n):
            d = min(decay, (1 + int(n)) / (10 + int(n)))
            return d * average + (1 - d) * weights

        average = AveragedModel(model, avg_fn=warmed)
    else:
        average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for step, parts in enumerate(batches):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        index = torch.from_numpy(np.concatenate(parts))
        loss = torch.nn.functional.cross_entropy(model(xt[index]), yt[index])
        if not torch.isfinite(loss):  # on_non_finite="skip": no update, no average
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
        average.update_parameters(model)
    return model, average.module.state_dict()


def state_distance(got, expected) -> float:
    """The largest difference between two state dicts' tensors, name for name."""
    return max(float((got[k].double() - expected[k].double()).abs().max()) for k in expected)


def assert_close_states(got, expected, tolerance):
    assert got is not None and set(got) == set(expected)
    worst = state_distance(got, expected)
    assert worst <= tolerance, worst


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, float("nan"), True, "0.9"], ids=str)
def test_a_decay_outside_zero_to_one_is_refused_naming_the_option(bad):
    x, y = make_data(16)
    with pytest.raises(ConfigError, match=r"Update\(ema_decay=.*strictly between 0 and 1"):
        tiny_pipeline(x, y, ema_decay=bad)


@pytest.mark.parametrize(
    "optimizer",
    [sgd, plain_sgd, adam, lambda p: dfl.ops.FusedAdam(p, lr=0.01)],
    ids=["momentum", "plain", "adam", "fused-adam"],
)
def test_one_replica_averages_as_torchs_averaged_model(optimizer):
    """After every step, the first copying the weights: torch's EMA, for optimizers that
    keep state (momentum, Adam's moments, set up when a parameter's state is empty) and
    one that keeps none; the trained weights are the loop's, untouched by the average."""
    x, y = make_data(96)
    pipe = tiny_pipeline(x, y, batch=16, optimizer=optimizer, ema_decay=DECAY)
    runtime, steps = in_process(pipe.trainer, epochs=2)
    try:
        runtime.run_window(0, len(steps))
        batches = pipe.sample_plan(epochs=2, replicas=1)
        model, average = averaged_reference(x, y, batches, optimizer=optimizer)
        assert max_abs_diff(runtime.context.model, model) <= 1e-6
        assert_close_states(runtime.averaged_state_dict(), average, 1e-6)
        weights = model.state_dict()  # (and the average is not the weights)
        assert state_distance(average, weights) > 1e-3
    finally:
        runtime.close()
    plain = tiny_pipeline(x, y, batch=16)  # without the option: no average
    runtime, steps = in_process(plain.trainer, epochs=1)
    try:
        runtime.run_window(0, len(steps))
        assert runtime.averaged_state_dict() is None
    finally:
        runtime.close()


def test_a_warmup_without_a_decay_or_not_a_bool_is_refused():
    x, y = make_data(16)
    with pytest.raises(ConfigError, match=r"ema_warmup=True.*give ema_decay"):
        tiny_pipeline(x, y, ema_warmup=True)
    with pytest.raises(ConfigError, match=r"ema_warmup='yes'.*True or False"):
        tiny_pipeline(x, y, ema_decay=0.9, ema_warmup="yes")


def test_a_warmed_up_average_follows_its_decay_rule():
    """``ema_warmup=True``: the decay after n updates is min(decay, (1 + n) / (10 + n)),
    torch's ``AveragedModel`` with that ``avg_fn``; the count lives in the optimizer
    state, so a rollback takes it back too."""
    x, y = make_data(96)
    pipe = tiny_pipeline(x, y, batch=16, ema_decay=0.99, ema_warmup=True)
    runtime, steps = in_process(pipe.trainer, epochs=2, commit_windows=False)
    try:
        runtime.run_window(0, 4)
        runtime.commit(4)
        runtime.run_window(4, len(steps))
        batches = pipe.sample_plan(epochs=2, replicas=1)
        _, average = averaged_reference(x, y, batches, decay=0.99, warmup=True)
        assert_close_states(runtime.averaged_state_dict(), average, 1e-6)
        _, plain = averaged_reference(x, y, batches, decay=0.99)
        worst = state_distance(plain, average)
        assert worst > 1e-3  # (12 updates: the warmed decay is far below 0.99)
        runtime.rollback(4)
        _, at_commit = averaged_reference(x, y, batches[:4], decay=0.99, warmup=True)
        assert_close_states(runtime.averaged_state_dict(), at_commit, 1e-6)
        [state] = [runtime.context.optimizer.state_dict()["state"][0]]
        assert state["ema_updates"] == 4
    finally:
        runtime.close()


@pytest.mark.parametrize("case", ["micro-batches", "captured", "skipped"])
def test_the_average_of_steps_made_any_way_and_of_none_skipped(case):
    """Each step's gradient accumulated over 2 micro-batches, or written by a captured
    step's replays (simulated on the CPU): the same average. A step skipped for a NaN
    (``on_non_finite="skip"``) is no update, so the average does not move either."""
    from test_non_finite import data_with_a_nan

    x, y = data_with_a_nan(96) if case == "skipped" else make_data(96)
    options = {"on_non_finite": "skip"} if case == "skipped" else {}
    pipe = tiny_pipeline(x, y, batch=16, ema_decay=DECAY, **options)
    spec = {
        "micro-batches": {"micro_batches": 2},
        "captured": {"capture": True, "simulate_capture": True},
        "skipped": {},
    }[case]
    runtime, steps = in_process(pipe.trainer, epochs=2, **spec)
    try:
        result = runtime.run_window(0, len(steps))
        if case == "skipped":
            assert len(result.skipped) == 2  # the NaN sample's step, each epoch
        if case == "captured":
            assert runtime.end_phase()["captured_steps"] == len(steps) - WARMUP
        _, average = averaged_reference(x, y, pipe.sample_plan(epochs=2, replicas=1))
        assert_close_states(runtime.averaged_state_dict(), average, 1e-6)
    finally:
        runtime.close()


def test_a_rollback_takes_the_average_back_to_the_commit():
    """The average is in the optimizer's state, so a commit holds it and a rollback
    restores it, bit for bit."""
    x, y = make_data(96)
    pipe = tiny_pipeline(x, y, batch=16, ema_decay=DECAY)
    runtime, _ = in_process(pipe.trainer, epochs=1, commit_windows=False)
    try:
        runtime.run_window(0, 2)
        runtime.commit(2)
        at_commit = runtime.averaged_state_dict()
        runtime.run_window(2, 4)
        once = runtime.averaged_state_dict()
        assert state_distance(once, at_commit) > 0
        runtime.rollback(2)
        assert_close_states(runtime.averaged_state_dict(), at_commit, 0.0)
    finally:
        runtime.close()


@pytest.mark.slow
def test_two_replicas_average_as_one_process_and_local_updates_average_the_averages(client):
    """Synchronous, an uneven 1:2 split: ``result.ema_model`` is the one-process loop's
    average. ``Local(period_steps=1)`` with plain SGD equals synchronous training, and
    each replica's average is averaged with the weights at every period's end (an
    average is linear), so its ``ema_model`` is the same, also when the optimizer's
    state is not averaged."""
    x, y = make_data(96)
    options = dict(batch=24, ema_decay=DECAY, balancer=dfl.balance.Proportional((1, 2)))
    sync = tiny_pipeline(x, y, optimizer=plain_sgd, **options)
    result = sync.fit(epochs=2, client=client)
    batches = sync.sample_plan(epochs=2, replicas=2)
    model, average = averaged_reference(x, y, batches, optimizer=plain_sgd)
    assert max_abs_diff(result.model, model) <= 1e-5
    assert_close_states(result.ema_model.state_dict(), average, 1e-5)
    local = dfl.sync.Local(period_steps=1, average_optimizer_state=False)
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, sync=local, **options)
    averaged = pipe.fit(epochs=2, client=client)
    assert_close_states(averaged.ema_model.state_dict(), average, 1e-5)
    assert tiny_pipeline(x, y, batch=24).fit(1, client=client).ema_model is None


@pytest.mark.slow
def test_the_parameter_store_keeps_the_average_of_the_versions_it_applies(client):
    """``Async``: the store applies the updates, so it moves the average at each version
    it applies, in the optimizer state the replicas take back at each window's end.
    ``Async(staleness=0)`` is synchronous training: the same average as the synchronous
    fit's, evaluations included; with staleness 1 an average is kept all the same."""
    from conftest import held_out_pipeline

    x, y = make_data(192)
    balancer = dfl.balance.Proportional((3, 1))
    options = dict(ema_decay=0.99, ema_warmup=True, balancer=balancer)  # the store counts
    synchronous = held_out_pipeline(x, y, **options).fit(2, client=client)
    zero = held_out_pipeline(x, y, sync=dfl.sync.Async(staleness=0), **options)
    stale = zero.fit(2, client=client)
    assert max_abs_diff(stale.model, synchronous.model) <= 1e-6
    assert_close_states(stale.ema_model.state_dict(), synchronous.ema_model.state_dict(), 1e-6)
    for mine, theirs in zip(stale.history.epochs, synchronous.history.epochs, strict=True):
        assert mine["eval_ema_loss"] == pytest.approx(theirs["eval_ema_loss"], rel=1e-5)
    one = held_out_pipeline(x, y, sync=dfl.sync.Async(staleness=1), **options)
    result = one.fit(2, client=client)
    average, weights = result.ema_model.state_dict(), result.model.state_dict()
    assert state_distance(average, weights) > 1e-4
    assert all(np.isfinite(e["eval_ema_loss"]) for e in result.history.epochs)


@pytest.mark.slow
def test_a_resumed_fit_ends_on_the_uninterrupted_fits_average(client, tmp_path):
    """BatchNorm, dropout, two phases with a warmup: resumed from inside a phase, the
    fit's average is the uninterrupted fit's, bit for bit (its buffers the model's);
    run again once finished, the same command returns it from the last checkpoint."""
    from test_mid_phase_checkpoints import _assert_same_weights, _keep_up_to, _pipeline

    x, y = make_data(160)
    folder = dict(checkpoint_dir=tmp_path, keep_checkpoints=1000)
    warmed = dict(ema_decay=0.9, ema_warmup=True)  # (its update count checkpointed too)
    full = _pipeline(x, y, **warmed).fit(3, client=client, checkpoint_every=1, **folder)
    mid = [c for c in full.history.info["checkpoints"] if c["mid_phase"]]
    _keep_up_to(
        CheckpointStore(tmp_path, keep=1000), CheckpointStore(tmp_path).path(mid[1]["step"])
    )
    resumed = _pipeline(x, y, **warmed).fit(3, client=client, resume=True, **folder)
    assert resumed.history.info["resumed_from"]["step"] == mid[1]["step"]
    _assert_same_weights(full.model, resumed.model)
    _assert_same_weights(full.ema_model, resumed.ema_model)
    buffers = dict(full.model.named_buffers())
    for name, value in full.ema_model.named_buffers():  # BatchNorm's: the trained model's
        assert torch.equal(value, buffers[name]), name
    again = _pipeline(x, y, **warmed).fit(3, resume=True, **folder)
    assert again.history.info["already_finished"]["epoch"] == 3
    _assert_same_weights(full.ema_model, again.ema_model)


def test_the_average_is_scored_beside_the_weights_and_keep_best_may_watch_it():
    """Pure: a graph that averages and evaluates records ``eval_ema_<metric>`` each
    evaluated epoch (keep_best and callbacks may name it); without ``ema_decay`` the
    name is refused with the closest one."""
    from conftest import held_out_pipeline

    from dataflow.callbacks import as_keep_best

    x, y = make_data(160)
    trainer = held_out_pipeline(x, y, ema_decay=0.9, eval_every=2).trainer
    assert {"eval_loss", "eval_ema_loss"} <= trainer.epoch_keys()
    assert trainer.metric_every("eval_ema_loss") == 2
    assert as_keep_best("eval_ema_loss", trainer.epoch_keys()).metric == "eval_ema_loss"
    plain = held_out_pipeline(x, y).trainer
    with pytest.raises(ConfigError, match="eval_ema_loss"):
        as_keep_best("eval_ema_loss", plain.epoch_keys())


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["sync", "local"])
def test_each_evaluation_scores_the_average_and_keep_best_keeps_the_averages_weights(client, sync):
    """2 replicas, a held-out set every epoch: each epoch's ``eval_ema_loss`` is the
    average's score, the last one ``pipe.evaluate`` of ``result.ema_model``; with
    ``keep_best="eval_ema_loss"`` the kept model is the average at its best epoch
    (scored again, its record's ``eval_ema_loss``, not its ``eval_loss``). Under local
    updates the evaluation scores the averaged weights' average, at the period's end."""
    from conftest import held_out_pipeline

    x, y = make_data(256)
    options = dict(ema_decay=0.9, train=192)
    if sync == "local":
        options["sync"] = dfl.sync.Local(period_steps=4)
    pipe = held_out_pipeline(x, y, **options)
    result = pipe.fit(4, client=client, keep_best="eval_ema_loss")
    epochs = result.history.epochs
    assert all(e["eval_ema_loss"] != e["eval_loss"] for e in epochs)
    held_out = dfl.io.ArraySource(x[192:], y[192:], shuffle=False)
    last = pipe.evaluate(held_out, result.ema_model)
    assert last["loss"] == pytest.approx(epochs[-1]["eval_ema_loss"], rel=1e-5)
    best = result.history.info["best"]
    kept = pipe.evaluate(held_out, result.best_model)
    assert kept["loss"] == pytest.approx(epochs[best["epoch"]]["eval_ema_loss"], rel=1e-5)
    assert best["value"] == min(e["eval_ema_loss"] for e in epochs)


@pytest.mark.slow
def test_a_spatial_group_averages_and_scores_the_whole_models_weights(client):
    """Two workers each hold half of every sample and the whole model: the average is
    the one-process loop's, and the group's evaluation scores it (the average swapped
    into the partitioned model on both workers alike) as ``pipe.evaluate`` does."""
    from conftest import held_out_pipeline

    x, y = make_data(96)
    options = dict(schedule=dfl.schedule.Fixed(32), ema_decay=DECAY, train=64)
    pipe = held_out_pipeline(x, y, layout=dfl.Layout(spatial=2), **options)
    result = pipe.fit(epochs=2, client=client)
    batches = held_out_pipeline(x, y, **options).sample_plan(epochs=2, replicas=1)
    model, average = averaged_reference(x[:64], y[:64], batches)
    assert max_abs_diff(result.model, model) <= 1e-5
    assert_close_states(result.ema_model.state_dict(), average, 1e-5)
    held_out = dfl.io.ArraySource(x[64:], y[64:], shuffle=False)
    scored = pipe.evaluate(held_out, result.ema_model)["loss"]
    assert scored == pytest.approx(result.history.epochs[-1]["eval_ema_loss"], rel=1e-5)
