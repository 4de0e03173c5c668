"""Captured steps (``capture=True``, stages/capture.py): a steady step's forward, loss
and backward replayed as one CUDA graph per input shape.

The graphs themselves need a GPU (tests/test_gpu.py). Here the same bookkeeping runs on
the CPU (``DATAFLOW_SIMULATE_CAPTURE=1``): inputs copied into static buffers, each
"replay" writing the step's loss, output and gradients into the tensors recorded at the
capture, so anything that kept a captured tensor too long, read a gradient the replay
did not attach, or ran a step eagerly that should have been replayed (or the reverse)
shows up as a difference from eager training, which must be none at all.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import TinyCNN, make_data, max_abs_diff, tiny_pipeline

import dataflow as dfl
from dataflow.core.errors import ConfigError
from dataflow.core.precision import SIMULATE_CAPTURE_ENV, StepOptions
from dataflow.core.step import ReplicaContext, StepContext, StepSpec
from dataflow.stages import Backward, Forward
from dataflow.stages.base import Batch, Stage
from dataflow.stages.capture import WARMUP, StepCapture

CPU = torch.device("cpu")


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setenv(SIMULATE_CAPTURE_ENV, "1")


def _loss(model):
    def compute(x, y):
        output = model(x)
        return torch.nn.functional.cross_entropy(output, y), output

    return compute


def _step(index=0, *, micro_count=1, loss_scale=None):
    replica = ReplicaContext(rank=0, world_size=1, device=CPU, seed=0, loss_scale=loss_scale)
    replica.window = (index, index + 1)  # each step a window of its own
    spec = StepSpec(
        index=index,
        epoch=0,
        step_in_epoch=index,
        start=0,
        global_batch=8,
        local_batches=(8,),
        last_in_epoch=False,
    )
    return StepContext(replica=replica, spec=spec, micro_count=micro_count)


def _batches(count, size=8, seed=0):
    x, y = make_data(count * size, seed=seed)
    return [
        Batch(x=torch.from_numpy(x[i : i + size]), y=torch.from_numpy(y[i : i + size]), size=size)
        for i in range(0, count * size, size)
    ]


def _eager_grads(model, batch):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(batch.x), batch.y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_shape_runs_eagerly_while_it_warms_up_then_replays_what_eager_computes():
    torch.manual_seed(0)
    model = TinyCNN()
    reference = TinyCNN()
    reference.load_state_dict(model.state_dict())
    capture = StepCapture(model, _loss(model), StepOptions(), CPU, simulate=True)
    batches = _batches(5)
    losses = []
    for i, batch in enumerate(batches):
        result = capture.run(_step(i), batch)
        if i < WARMUP:
            assert result is None  # the caller runs this step eagerly
            continue
        loss, _ = result
        losses.append(loss)
        expected = _eager_grads(reference, batch)
        for param, grad in zip(model.parameters(), expected, strict=True):
            assert torch.equal(param.grad, grad)
        model.zero_grad()  # as Update does: the next replay attaches them again
    # each step's loss is its own, not the graph's tensor that the next replay overwrote
    expected_losses = [
        torch.nn.functional.cross_entropy(reference(b.x), b.y) for b in batches[WARMUP:]
    ]
    assert [float(v) for v in losses] == [float(v.detach()) for v in expected_losses]
    report = capture.phase_report()
    assert (report["captured_shapes"], report["captured_steps"]) == (1, 5 - WARMUP)


def test_each_shape_is_captured_once_and_a_phase_starts_afresh():
    model = TinyCNN()
    capture = StepCapture(model, _loss(model), StepOptions(), CPU, simulate=True)
    long, short = _batches(6), _batches(3, size=5)
    ran = [capture.run(_step(), b) is not None for b in long[:3] + short + long[3:]]
    assert ran == [False, False, True, False, False, True, True, True, True]
    assert capture.phase_report()["captured_shapes"] == 2
    capture.reset()  # the next phase: warm up again
    assert [capture.run(_step(), b) is not None for b in long[:3]] == [False, False, True]


@pytest.mark.parametrize(
    "why",
    ["fp16 loss scale", "evaluation mode", "an empty batch", "not tensors"],
)
def test_steps_a_graph_cannot_replay_run_eagerly(why):
    model = TinyCNN()
    capture = StepCapture(model, _loss(model), StepOptions(), CPU, simulate=True)
    batches = _batches(WARMUP + 1)
    for batch in batches[:WARMUP]:
        capture.run(_step(), batch)
    step, batch = _step(), batches[-1]
    if why == "fp16 loss scale":
        step = _step(loss_scale=object())
    elif why == "evaluation mode":
        model.eval()
    elif why == "an empty batch":
        batch = Batch(x=batch.x[:0], y=batch.y[:0], size=0)
    else:
        batch = Batch(x=[batch.x], y=batch.y, size=batch.size)
    assert capture.run(step, batch) is None


def test_a_shape_that_cannot_be_captured_runs_eagerly_and_says_why():
    model = TinyCNN()
    calls = []

    def compute(x, y):
        calls.append(1)
        if len(calls) == 1:  # the capture's call: what torch raises for a host read
            raise RuntimeError("operation not permitted when stream is capturing")
        return _loss(model)(x, y)

    capture = StepCapture(model, compute, StepOptions(), CPU, simulate=True)
    batches = _batches(WARMUP + 3)
    for batch in batches[:WARMUP]:
        assert capture.run(_step(), batch) is None
    with pytest.warns(RuntimeWarning, match="could not be captured as a CUDA graph"):
        assert capture.run(_step(), batches[WARMUP]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not again
        assert all(capture.run(_step(), b) is None for b in batches[WARMUP + 1 :])
    report = capture.phase_report()
    assert report["captured_steps"] == 0
    assert report["capture_failures"] == [
        "RuntimeError: operation not permitted when stream is capturing"
    ]


def test_weights_that_move_in_memory_are_captured_again_not_read_where_they_were():
    model = TinyCNN()
    capture = StepCapture(model, _loss(model), StepOptions(), CPU, simulate=True)
    batches = _batches(2 * WARMUP + 2)
    assert [capture.run(_step(), b) is not None for b in batches[: WARMUP + 1]][-1]
    model.conv.weight.data = model.conv.weight.data.clone()  # what module.to() may do
    after = [capture.run(_step(), b) is not None for b in batches[WARMUP + 1 :]]
    assert after == [False] * WARMUP + [True]
    (note,) = capture.phase_report()["capture_failures"]
    assert "moved in memory 1 time(s)" in note


def test_capture_is_refused_where_it_cannot_work(simulated, monkeypatch):
    x, y = make_data(32)
    refusals = {
        "precision='fp16'": dict(precision="fp16"),
        "compile=True: pick one": dict(compile=True),
        "a spatial layout": dict(layout=dfl.Layout(spatial=2)),
    }
    for message, options in refusals.items():
        with pytest.raises(ConfigError, match=f"capture=True with {message}"):
            tiny_pipeline(x, y, capture=True, device="cuda", **options)
    with pytest.raises(ConfigError, match="capture='yes': use True"):
        tiny_pipeline(x, y, capture="yes")
    monkeypatch.delenv(SIMULATE_CAPTURE_ENV)
    with pytest.raises(ConfigError, match="capture=True with device='cpu': CUDA graphs need"):
        tiny_pipeline(x, y, capture=True)


class _Penalty(Stage):
    """A user stage between Forward and Backward: adds to the loss."""

    def run(self, step, out):
        out.loss = out.loss + 0.0
        return out


def test_a_graph_whose_loss_goes_through_another_stage_is_refused(simulated):
    x, y = make_data(32)
    graph = dfl.Graph()
    load = graph.add(dfl.stages.Load(dfl.io.ArraySource(x, y)))
    forward = graph.add(Forward(TinyCNN, torch.nn.functional.cross_entropy), load)
    penalty = graph.add(_Penalty(), forward)
    graph.add(dfl.stages.Update(torch.optim.SGD), graph.add(Backward(), penalty))
    trainer = dfl.Trainer(
        graph, schedule=dfl.schedule.Fixed(8), device="cpu", capture=True, progress=False
    )
    with pytest.raises(ConfigError, match=r"Forward stage 'Forward' feeds 1 stage.*'_Penalty'"):
        trainer.fit(epochs=1)
    assert (
        dfl.Pipeline(
            model=TinyCNN,
            loss=torch.nn.functional.cross_entropy,
            optimizer=torch.optim.SGD,
            source=dfl.io.ArraySource(x, y),
            schedule=dfl.schedule.Fixed(8),
        ).graph.capture_blocker()
        is None
    )


def _replayed(history):
    """Steps a fit of full steps only should replay: each phase's steps but the first
    WARMUP (a phase has one local batch: one graph)."""
    return sum(max(0, phase.steps - WARMUP) for phase in history.phases)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_captured_fit_is_the_eager_fit_bit_for_bit(client, simulated, replicas):
    x, y = make_data(170)
    eager = tiny_pipeline(x, y, replicas=replicas).fit(epochs=3, client=client)
    captured = tiny_pipeline(x, y, replicas=replicas, capture=True).fit(epochs=3, client=client)
    assert max_abs_diff(eager.model, captured.model) == 0.0
    assert [s.loss for s in captured.history.steps] == [s.loss for s in eager.history.steps]
    (phase,) = captured.history.phases
    # 3 epochs of 10 full steps and a short one (170 = 10 x 16 + 10): each shape is
    # replayed from its third step on
    assert phase.captured_steps == [(30 - WARMUP) + (3 - WARMUP)] * replicas
    assert phase.captured_shapes == [2] * replicas
    assert phase.capture_failures is None
    assert {w["capture"] for w in captured.history.info["workers"]} == {"simulated"}
    assert eager.history.phases[0].captured_steps is None
    replayed = f"steps replayed as CUDA graphs per replica {phase.captured_steps} of 33"
    assert replayed in captured.summary() and "CUDA graphs" not in eager.summary()


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        # a growing batch (a new graph each phase), evaluation, bf16, uneven split
        dict(
            schedule=dfl.schedule.Stepwise({0: 16, 1: 32}),
            eval_source="held-out",
            precision="bf16",
            replicas=2,
        ),
        dict(sync=dfl.sync.Local(period_steps=4, leases=False), replicas=2),
        # accumulation: each micro-batch replayed, the gradients summed in shared buffers
        dict(max_micro_batch=6, replicas=2),
        dict(max_micro_batch=5, schedule=dfl.schedule.Fixed(16)),  # micro-batches 5, 5, 6
        dict(on_non_finite="skip", optimizer=lambda p: torch.optim.Adam(p, lr=1e-3)),
    ],
    ids=["stepwise-eval-bf16", "local", "micro-batches", "uneven-micro-batches", "skip-adam"],
)
def test_captured_steps_meet_the_other_features(client, simulated, options):
    x, y = make_data(160)
    if options.get("eval_source") == "held-out":
        hx, hy = make_data(48, seed=1)
        options = {**options, "eval_source": dfl.io.ArraySource(hx, hy)}
    eager = tiny_pipeline(x, y, **options).fit(epochs=2, client=client)
    captured = tiny_pipeline(x, y, capture=True, **options).fit(epochs=2, client=client)
    assert max_abs_diff(eager.model, captured.model) == 0.0
    assert [s.loss for s in captured.history.steps] == [s.loss for s in eager.history.steps]
    replicas = len(captured.history.phases[0].local_batches)
    replayed = [sum(p.captured_steps[r] for p in captured.history.phases) for r in range(replicas)]
    assert replayed == [_replayed(captured.history)] * replicas
    assert min(replayed) > 0
    if "eval_source" in options:
        assert [e.metrics["eval_loss"] for e in captured.history.epochs] == [
            e.metrics["eval_loss"] for e in eager.history.epochs
        ]
    assert np.all(np.isfinite([s.loss for s in captured.history.steps]))


@pytest.mark.slow
def test_capture_on_workers_without_a_gpu_warns_and_trains_eagerly(client):
    """device='auto' on CPU workers: capture=True cannot capture there; the fit says so
    once, names the replicas, and trains as the eager fit does."""
    x, y = make_data(64)
    eager = tiny_pipeline(x, y, replicas=2).fit(epochs=1, client=client)
    with pytest.warns(RuntimeWarning, match=r"capture=True, but replicas \[0, 1\] run on"):
        asked = tiny_pipeline(x, y, replicas=2, device="auto", capture=True).fit(
            epochs=1, client=client
        )
    assert asked.history.info["capture_off"] == [0, 1]
    assert {w["capture"] for w in asked.history.info["workers"]} == {"off"}
    assert asked.history.phases[0].captured_steps is None
    assert max_abs_diff(eager.model, asked.model) == 0.0


def test_the_no_gpu_warning_points_at_the_users_line_not_the_engines():
    """Raised deep in the driver, attributed to the first frame outside the engine."""
    from dataflow.driver.worker_notes import record_workers

    info: dict = {}
    with pytest.warns(RuntimeWarning, match="capture=True, but replicas") as caught:
        record_workers(info, [{"rank": 0, "capture": "off"}], capture=True)
    assert caught[0].filename == __file__
    record_workers(info, [{"rank": 1, "capture": "off"}], capture=True)  # once a fit
    assert info["capture_off"] == [0]


def _micro_step(index, k, count=2, size=4):
    step = _step(index)
    step.micro_count, step.micro_index, step.micro_size = count, k, size
    return step


def test_micro_batches_replay_into_shared_gradients_only_after_a_replayed_first_one():
    """Gradient accumulation: the first micro-batch's graph writes the gradients into
    buffers every micro-batch graph shares, the others add to them, as eager
    accumulation does; a later micro-batch never adds onto gradients an eager first
    micro-batch left (it runs eagerly too)."""
    torch.manual_seed(0)
    model, reference = TinyCNN(), TinyCNN()
    reference.load_state_dict(model.state_dict())
    capture = StepCapture(model, _loss(model), StepOptions(), CPU, simulate=True)
    halves = _batches(2 * (WARMUP + 2), size=4)
    for i in range(WARMUP + 2):
        parts = halves[2 * i : 2 * i + 2]
        if i == WARMUP + 1:  # this step's first micro-batch runs eagerly (a fallback)
            (torch.nn.functional.cross_entropy(model(parts[0].x), parts[0].y) * 0.5).backward()
            assert capture.run(_micro_step(i, 1), parts[1]) is None
            (torch.nn.functional.cross_entropy(model(parts[1].x), parts[1].y) * 0.5).backward()
        else:
            for k, part in enumerate(parts):
                if capture.run(_micro_step(i, k), part) is None:
                    loss = torch.nn.functional.cross_entropy(model(part.x), part.y) * 0.5
                    loss.backward()
        reference.zero_grad()
        for part in parts:
            (torch.nn.functional.cross_entropy(reference(part.x), part.y) * 0.5).backward()
        for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(param.grad, expected.grad), i
        model.zero_grad()
    report = capture.phase_report()
    assert (report["captured_shapes"], report["captured_steps"]) == (2, 1)


@pytest.mark.slow
def test_adaptive_measured_steps_are_captured_too_and_the_fit_is_the_eager_one(client, simulated):
    """One replica under Adaptive measures the noise on micro-batched steps (its first
    micro-batch's gradient inside the step's): those replay as micro-batch graphs, read
    between the two, and the fit and its noise-scale decisions equal the eager fit's."""
    x, y = make_data(192)
    options = dict(schedule=dfl.schedule.Adaptive(8, max_batch=64), window_steps=4, replicas=1)
    eager = tiny_pipeline(x, y, **options).fit(epochs=3, client=client)
    captured = tiny_pipeline(x, y, capture=True, **options).fit(epochs=3, client=client)
    assert max_abs_diff(eager.model, captured.model) == 0.0
    assert [p.global_batch for p in captured.history.phases] == [
        p.global_batch for p in eager.history.phases
    ]
    assert [s.loss for s in captured.history.steps] == [s.loss for s in eager.history.steps]
    assert sum(sum(p.captured_steps) for p in captured.history.phases) > 0
