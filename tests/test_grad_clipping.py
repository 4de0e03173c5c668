"""``clip_grad_norm=``: the gradient an update applies is scaled to a norm of at most the
bound, as ``torch.nn.utils.clip_grad_norm_`` in a one-process loop, under every sync
policy, precision and step option; each step's norm before clipping is in the history.

The one-replica tests run the replica in this process (milliseconds); the ones marked
slow train on a real LocalCluster with real gloo collectives."""

import math

import numpy as np
import pytest
import torch
from conftest import (
    TinyCNN,
    in_process,
    make_data,
    max_abs_diff,
    reference_training,
    tiny_pipeline,
)

import dataflow as dfl
from dataflow.core.errors import ConfigError
from dataflow.core.precision import CPU_FP16_ENV
from dataflow.driver.step_values import step_grad_norms
from dataflow.history.report import write_steps_csv
from dataflow.stages.capture import WARMUP

BOUND = 0.05  # below every step's norm on make_data with TinyCNN (0.2-0.6): all clip


def clipped_reference(x, y, batches, max_norm=BOUND, **options):
    """The one-process torch loop that clips before each update; its norms before."""
    norms: list[float] = []

    def clip(model):
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))

    model = reference_training(x, y, batches=batches, seed=0, after_backward=clip, **options)
    return model, norms


def train_in_process(pipe, epochs, **spec):
    """One replica, one window of ``epochs``: its model, WindowResult and phase stats."""
    runtime, steps = in_process(pipe.trainer, epochs=epochs, **spec)
    try:
        result = runtime.run_window(0, len(steps))
        return runtime.context.model, result, runtime.end_phase()
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "bad", [0, -1.0, float("nan"), True, "1.0"], ids=["zero", "negative", "nan", "bool", "str"]
)
def test_a_bound_that_is_not_a_positive_number_is_refused_naming_the_option(bad):
    x, y = make_data(16)
    with pytest.raises(ConfigError, match=r"Update\(clip_grad_norm=.*a number > 0.*'inf'"):
        tiny_pipeline(x, y, clip_grad_norm=bad)


@pytest.mark.parametrize(
    "case",
    ["plain", "micro-batches", "captured"],
)
def test_one_replica_clips_as_torch_does_and_records_each_norm(case):
    """The engine's update equals torch's ``clip_grad_norm_`` before ``opt.step()``, and
    each step's recorded norm is the one torch returned, in whatever way the step's
    gradient was made: whole, accumulated over 2 micro-batches, or written by a captured
    step's replays (simulated on the CPU)."""
    x, y = make_data(96)
    pipe = tiny_pipeline(x, y, batch=16, clip_grad_norm=BOUND)
    spec = {
        "plain": {},
        "micro-batches": {"micro_batches": 2},
        "captured": {"capture": True, "simulate_capture": True},
    }[case]
    model, result, stats = train_in_process(pipe, 2, **spec)
    if case == "captured":
        assert stats["captured_steps"] == 12 - WARMUP  # the gradients of replays clipped
    expected, norms = clipped_reference(x, y, pipe.sample_plan(epochs=2, replicas=1))
    assert len(result.grad_norms) == len(norms) == 12
    assert min(norms) > BOUND  # every step clipped
    assert result.grad_norms == pytest.approx(norms, rel=1e-5)
    assert max_abs_diff(model, expected) <= 1e-6


def test_an_infinite_bound_records_the_norms_and_changes_nothing():
    x, y = make_data(64)
    pipe = tiny_pipeline(x, y, batch=16, clip_grad_norm=math.inf)
    model, result, _ = train_in_process(pipe, 1)
    batches = pipe.sample_plan(epochs=1, replicas=1)
    _, norms = clipped_reference(x, y, batches, max_norm=math.inf)
    assert result.grad_norms == pytest.approx(norms, rel=1e-6)
    assert max_abs_diff(model, reference_training(x, y, batches=batches, seed=0)) == 0.0
    plain = tiny_pipeline(x, y, batch=16)  # without the option: no norms, no work
    assert train_in_process(plain, 1)[1].grad_norms == []


def test_fp16_clips_the_unscaled_gradient(monkeypatch):
    """fp16 scales the loss by 2^16 before backward; the bound applies to the gradient
    with that scale divided out, so the norms and the weights are fp32's, to fp16's
    rounding (on the scaled gradient they would be 65536 times larger, and every update
    a 65536-fold smaller step)."""
    monkeypatch.setenv(CPU_FP16_ENV, "1")  # fp16 on the CPU: tests only
    x, y = make_data(64)
    pipe = tiny_pipeline(x, y, batch=16, clip_grad_norm=BOUND, precision="fp16")
    model, result, _ = train_in_process(pipe, 1, precision="fp16", allow_cpu_fp16=True)
    _, fp32, _ = train_in_process(tiny_pipeline(x, y, batch=16, clip_grad_norm=BOUND), 1)
    assert result.grad_norms == pytest.approx(fp32.grad_norms, rel=2e-2)
    expected, _ = clipped_reference(x, y, pipe.sample_plan(epochs=1, replicas=1))
    assert max_abs_diff(model, expected) <= 1e-3


def test_the_recorded_norm_of_a_step_weighs_each_replica_by_its_samples():
    """Pure: synchronous replicas report the same norm (the reduced gradient's); local or
    asynchronous ones their own, weighed by the samples each trained; a lost replica's
    (not known) and a replica that reported none count for nothing."""

    class Result:
        def __init__(self, grad_norms):
            self.grad_norms = grad_norms

    samples = np.array([[8, 24, 0], [24, 8, 0]])
    known = np.ones_like(samples, dtype=bool)
    window = [Result([1.0, 2.0, None]), Result([3.0, 4.0, None])]
    assert step_grad_norms(window, samples, known) == [2.5, 2.5, None]
    known[1] = False  # replica 1 lost: its parts were salvaged, its norms unknown
    assert step_grad_norms(window, samples, known) == [1.0, 2.0, None]
    assert step_grad_norms([Result([]), Result([])], samples, known) == [None] * 3


@pytest.mark.slow
def test_two_replicas_clip_the_global_batch_gradient_as_one_process_would(client, tmp_path):
    """Each replica clips the reduced gradient by the factor its norm gives, the same on
    both: the weights are the one-process loop's that clips the global batch's gradient,
    on an uneven split, and the history holds torch's norms, in the steps CSV too."""
    x, y = make_data(96)
    options = dict(batch=24, clip_grad_norm=BOUND, balancer=dfl.balance.Proportional((1, 2)))
    result = tiny_pipeline(x, y, **options).fit(epochs=2, client=client)
    batches = tiny_pipeline(x, y, **options).sample_plan(epochs=2, replicas=2)
    expected, norms = clipped_reference(x, y, batches)
    assert result.history.phases[0]["local_batches"] == [8, 16]
    assert max_abs_diff(result.model, expected) <= 1e-5
    recorded = [step["grad_norm"] for step in result.history.steps]
    assert recorded == pytest.approx(norms, rel=1e-5)
    header, first = write_steps_csv(result.history, tmp_path / "steps.csv").read_text().split()[:2]
    column = header.split(",").index("grad_norm")
    assert float(first.split(",")[column]) == pytest.approx(norms[0], rel=1e-5)


@pytest.mark.slow
def test_a_spatial_group_clips_the_whole_samples_gradient(client):
    """Two workers each hold half of every sample, and so a part of each weight's
    gradient: the group sums the parts before the bound applies, so the norm is the
    whole gradient's (the one-process loop's), not a rank's part of it."""
    x, y = make_data(64)
    options = dict(batch=32, clip_grad_norm=BOUND)
    pipe = tiny_pipeline(x, y, layout=dfl.Layout(spatial=2), **options)
    result = pipe.fit(epochs=2, client=client)
    batches = tiny_pipeline(x, y, **options).sample_plan(epochs=2, replicas=1)
    expected, norms = clipped_reference(x, y, batches)
    assert max_abs_diff(result.model, expected) <= 1e-5
    assert [step["grad_norm"] for step in result.history.steps] == pytest.approx(norms, rel=1e-5)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.1)  # no momentum: a clipped step moves lr x bound


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync",
    [dfl.sync.Local(period_steps=3), dfl.sync.Async(staleness=1)],
    ids=["local", "async"],
)
def test_local_and_asynchronous_updates_clip_each_replicas_own_gradient(client, sync):
    """No reduced gradient here: each replica clips its own (local updates, before its
    step; asynchronous ones, before it is pushed). With plain SGD each step then moves
    the weights by at most lr x bound, whatever the averaging or the store's order: the
    fit ends within steps x lr x bound of where it began, while every recorded norm
    (the replicas' own, weighed by samples) is far above the bound."""
    x, y = make_data(96)
    bound = 1e-3
    pipe = tiny_pipeline(x, y, batch=16, optimizer=plain_sgd, clip_grad_norm=bound, sync=sync)
    result = pipe.fit(epochs=2, client=client)
    torch.manual_seed(0)  # the fit's first weights (seed 0), as reference_training's
    start = torch.cat([p.detach().reshape(-1) for p in TinyCNN().parameters()])
    end = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    steps = len(result.history.steps)
    assert steps == 12
    moved = float((end - start).norm())
    assert 0 < moved <= steps * 0.1 * bound * (1 + 1e-4)
    assert all(step["grad_norm"] > 100 * bound for step in result.history.steps)


def test_a_window_result_pickled_before_the_norms_existed_loads_without_them():
    """Driver logs saved for bug reports hold pickled window results: one from before a
    field existed loads with that field's default, and the recorder reads no norms."""
    import pickle

    from dataflow.core.window import WindowResult

    old = WindowResult(0, 0, [16], [0.5], [0.1], {}, 0.1)
    del old.__dict__["grad_norms"]  # as a result pickled by an earlier version
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.grad_norms == [] and loaded.losses == [0.5]
    assert step_grad_norms([loaded], np.array([[16]]), np.array([[True]])) == [None]
