"""The LR over the whole fit (``Pipeline(lr_decay=...)``): a warmup and a decay on top of
the schedule's phases, by the epochs trained, whatever the batch.

The shapes and the plan are pure (milliseconds); on a real LocalCluster, a fit with a
decay equals the single-process torch loop run at the same LR per step, under every
sync policy, and a fit resumed from a checkpoint inside a decay is bit-identical.
"""

import math

import numpy as np
import pytest
import torch
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline

import dataflow as dfl
from dataflow.checkpoint import CheckpointStore
from dataflow.errors import ConfigError
from dataflow.schedule import CosineDecay, PolynomialDecay, StepDecay, Warmup, lr_at

# -- the shapes, pure --------------------------------------------------------------------


def test_a_warmup_ramps_linearly_from_its_start_then_the_decay_takes_over():
    decay = StepDecay({30: 0.1, 60: 0.01}, warmup_epochs=5, warmup_start=0.2)
    assert decay.factor(0, 90) == pytest.approx(0.2)
    assert decay.factor(2.5, 90) == pytest.approx(0.6)
    assert [decay.factor(p, 90) for p in (5, 29.99, 30, 59.5, 60, 89)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01]
    )
    assert Warmup(warmup_epochs=2).factor(1, 10) == pytest.approx(0.5)
    assert Warmup(warmup_epochs=2).factor(7, 10) == 1.0


def test_cosine_and_polynomial_run_from_the_warmup_end_to_final_at_the_horizon():
    cosine = CosineDecay(warmup_epochs=2, final=0.1)
    assert cosine.factor(2, 12) == pytest.approx(1.0)
    assert cosine.factor(7, 12) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: the mean
    assert cosine.factor(12, 12) == pytest.approx(0.1)
    assert cosine.factor(30, 12) == pytest.approx(0.1)  # past the horizon: final
    linear = PolynomialDecay(final=0.0)
    assert [linear.factor(p, 4) for p in (0, 1, 3)] == pytest.approx([1, 0.75, 0.25])
    square = PolynomialDecay(power=2.0)
    assert square.factor(2, 4) == pytest.approx(0.25)
    # a fixed horizon: the curve does not stretch with the fit's epochs
    fixed = CosineDecay(epochs=10)
    assert fixed.factor(5, 10) == fixed.factor(5, 40) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: StepDecay({}), "give a dict"),
        (lambda: StepDecay({-1: 0.1}), "must be >= 0"),
        (lambda: StepDecay({10: -0.5}), "factor at epoch 10 is < 0"),
        (lambda: StepDecay({10: "x"}), "factors[10]"),
        (lambda: CosineDecay(final=1.5), "final=1.5"),
        (lambda: CosineDecay(epochs=0), "epochs=0"),
        (lambda: PolynomialDecay(power=0), "power=0"),
        (lambda: Warmup(), "warmup_epochs=0"),
        (lambda: Warmup(warmup_epochs=1, warmup_start=2), "warmup_start=2"),
        (lambda: CosineDecay(warmup_epochs=float("nan")), "warmup_epochs=nan"),
    ],
)
def test_a_bad_decay_is_named(make, says):
    with pytest.raises(ConfigError) as caught:
        make()
    assert says in str(caught.value)


def test_a_decay_is_checked_against_the_fit_before_any_work():
    x, y = make_data(32)
    with pytest.raises(ConfigError, match=r"lr_decay=0\.1"):
        tiny_pipeline(x, y, lr_decay=0.1)
    pipe = tiny_pipeline(x, y, lr_decay=CosineDecay(warmup_epochs=5))
    with pytest.raises(ConfigError, match="nothing to decay over"):
        pipe.plan(epochs=3, replicas=2)
    with pytest.raises(ConfigError, match="nothing to decay over"):
        pipe.fit(epochs=3, client=object())  # refused before the client is used


def test_each_planned_step_carries_the_factor_at_its_progress_in_epochs():
    """By epochs, not steps: a phase at twice the batch has half the steps per epoch, and
    the factor follows the samples seen. Without a decay, steps carry none."""
    x, y = make_data(64)
    decay = CosineDecay(warmup_epochs=0.5, warmup_start=0.1, final=0.05)
    schedule = dfl.schedule.Stepwise({0: 8, 1: 16, 2: 32})
    pipe = tiny_pipeline(x, y, schedule=schedule, lr_decay=decay)
    steps = [s for plan in pipe.plan(epochs=3, replicas=2) for s in plan.steps]
    assert len(steps) == 8 + 4 + 2
    for spec in steps:
        assert spec.lr_decay == decay.factor(spec.epoch + spec.start / 64, 3)
    assert steps[0].lr_decay == pytest.approx(0.1)
    assert steps[8].lr_decay == pytest.approx(0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert steps[-1].lr_decay == pytest.approx(decay.factor(2.5, 3))
    plain = tiny_pipeline(x, y, schedule=schedule).plan(epochs=3, replicas=2)
    assert all(s.lr_decay is None for plan in plain for s in plan.steps)


def test_counting_progress_the_decay_follows_the_progress_not_the_data():
    """Stepwise(scale_invariant=True): the fit's epochs are epochs of progress and the
    decay runs over them; with no measurement (a plan) each grown phase is credited a
    gain of 1, the longest it can run: B/B0 epochs of data per epoch of progress."""
    x, y = make_data(64)
    decay = CosineDecay(final=0.0)
    schedule = dfl.schedule.Stepwise({0: 8, 1: 16, 2: 32}, scale_invariant=True)
    pipe = tiny_pipeline(x, y, schedule=schedule, lr_decay=decay)
    plans = pipe.plan(epochs=3, replicas=2)
    assert [(p.phase.start_epoch, p.phase.end_epoch) for p in plans] == [(0, 1), (1, 3), (3, 7)]
    assert [p.phase.progress_end for p in plans] == [1.0, 2.0, 3.0]
    steps = [s for plan in plans for s in plan.steps]
    assert len(steps) == 8 + 2 * 4 + 4 * 2
    for plan in plans:
        for spec in plan.steps:
            progress = plan.phase.progress_at(spec.epoch + spec.start / 64)
            assert spec.lr_decay == decay.factor(progress, 3)
    # half way through the progress: the second epoch of data at batch 16 (step 12), 0.5;
    # the last phase (4 epochs of data for the last one of progress) starts at 0.25
    assert steps[12].lr_decay == pytest.approx(0.5)
    assert steps[16].lr_decay == pytest.approx(0.25)


# -- on a cluster ------------------------------------------------------------------------


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def _expected_lrs(pipe, decay, epochs, n, phases):
    """The LR of each step: the Stepwise ramp of each phase (linear scaling, 2 warmup
    steps after the first phase) times the decay at the step's progress."""
    lrs, previous = [], 0.02
    for index, (batch, steps) in enumerate(phases):
        target = 0.02 * batch / phases[0][0]
        lrs += [lr_at(previous, target, k, 2 if index else 0) for k in range(steps)]
        previous = target
    specs = [s for plan in pipe.plan(epochs=epochs, replicas=2) for s in plan.steps]
    factors = [decay.factor(s.epoch + s.start / n, epochs) for s in specs]
    return [lr * factor for lr, factor in zip(lrs, factors, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync",
    [None, dfl.sync.Async(staleness=0), dfl.sync.Local(period_steps=1)],
    ids=["synchronous", "async-staleness-0", "local-every-step"],
)
def test_a_decayed_fit_equals_the_single_process_loop_at_the_same_lrs(client, sync):
    """A growing batch (Stepwise, with its own ramps) under a warmup and a cosine decay,
    evaluated each epoch: each step's LR in the history is the ramp times the decay, and
    the weights are the plain torch loop's run at those LRs. Under asynchronous updates
    the parameter store applies the step at that LR; under local updates each replica."""
    x, y = make_data(96)
    decay = CosineDecay(warmup_epochs=0.5, warmup_start=0.1, final=0.05)
    options = dict(
        optimizer=plain_sgd,
        schedule=dfl.schedule.Stepwise({0: 8, 1: 16, 2: 32}, lr_scaling="linear", warmup_steps=2),
        lr_decay=decay,
        eval_source=dfl.io.ArraySource(x[:32], y[:32], shuffle=False),
    )
    if sync is not None:
        options.update(sync=sync)
    pipe = tiny_pipeline(x, y, **options)
    result = pipe.fit(epochs=3, client=client)
    lrs = _expected_lrs(pipe, decay, 3, 96, [(8, 12), (16, 6), (32, 3)])
    assert [s["lr"] for s in result.history.steps] == pytest.approx(lrs, rel=1e-12)
    assert result.history.phases[-1]["lr"] == pytest.approx(lrs[-1])
    batches = pipe.sample_plan(epochs=3, replicas=2)
    expected = reference_training(x, y, batches=batches, seed=0, optimizer=plain_sgd, lrs=lrs)
    assert max_abs_diff(result.model, expected) <= 1e-5
    assert all(np.isfinite(e["eval_loss"]) for e in result.history.epochs)


@pytest.mark.slow
def test_a_fit_resumed_inside_a_decay_is_bit_identical(client, tmp_path):
    """A mid-phase checkpoint in the second phase (inside its ramp and the decay): the
    resumed fit runs every step at the LR it had, and ends on the same weights."""
    x, y = make_data(160)

    def pipe():
        return tiny_pipeline(
            x,
            y,
            schedule=dfl.schedule.Stepwise({0: 16, 1: 32}, warmup_steps=3),
            lr_decay=StepDecay({1.5: 0.5, 2: 0.25}, warmup_epochs=0.5, warmup_start=0.5),
            window_steps=2,
        )

    full = pipe().fit(
        3, client=client, checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=1000
    )
    store = CheckpointStore(tmp_path, keep=1000)
    point = next(c for c in full.history.info["checkpoints"] if c["mid_phase"] and c["phase"])
    for newer in [p for p in store.checkpoints() if p.name > store.path(point["step"]).name]:
        newer.unlink()
        CheckpointStore.manifest_path(newer).unlink()
    resumed = pipe().fit(3, client=client, checkpoint_dir=tmp_path, resume=True)
    assert resumed.history.info["resumed_from"]["step"] == point["step"]
    assert [s["lr"] for s in resumed.history.steps] == [s["lr"] for s in full.history.steps]
    assert len({s["lr"] for s in full.history.steps}) > 6  # the ramps and both decays
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
