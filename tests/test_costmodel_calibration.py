"""Calibration on a real LocalCluster (two single-threaded worker processes): every term
is measured and explained, a fit with ``cost_model=`` records its prediction next to its
steady step time, and bad input is refused with the fix. No timing is asserted: only
that each term was measured, and what its shape must be."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TinyCNN, make_data, tiny_pipeline
from distributed import Client, LocalCluster

import dataflow as dfl
from dataflow.costmodel import CostModel, calibrate
from dataflow.driver.recorder import steady_step_seconds
from dataflow.errors import BatchSizeError, ConfigError, DataflowError, LossError, ModelError

QUICK = dict(steps=2, warmup=1, repeats=2, allreduce_sizes=(4, 4096, 65536), allreduce_repeats=3)


@pytest.fixture(scope="module")
def data():
    return make_data(160)


@pytest.fixture(scope="module")
def calibrated(client, data):
    x, y = data
    return calibrate(tiny_pipeline(x, y, batch=16), client, **QUICK)


def test_calibrate_measures_every_term(calibrated):
    model = calibrated
    batches = [b for b, _ in model.compute.points]
    seconds = [t for _, t in model.compute.points]
    assert batches == sorted(set(batches)) and len(batches) == 3  # spanning 16/2 .. 16
    assert batches[0] == 8 and batches[-1] == 16
    assert all(t > 0 for t in seconds) and seconds == sorted(seconds)
    assert 0 < model.compute.backward_fraction < 1
    link = model.topology.intra
    assert link.latency_s > 0 and link.bandwidth > 0 and link.source.startswith("calibrated")
    assert model.topology.per_node == 2 and model.topology.inter is None  # one machine
    assert model.compute.shared[0][0] == 2 and model.compute.shared[0][1] >= 1
    assert model.sync_overhead_s >= 0 and model.notes["sync_overhead_s"]
    assert model.window_overhead_s > 0 and model.phase_overhead_s > model.window_overhead_s
    assert model.load_samples_per_s > 0
    params = sum(p.numel() * 4 for p in TinyCNN().parameters())
    assert model.gradient_bytes == params and model.memory.parameter_bytes == params
    assert model.memory.optimizer_states == 1  # SGD's momentum buffer
    assert model.memory.activation_bytes_per_sample > 0
    terms = ("compute", "topology", "load_samples_per_s", "window_overhead_s", "memory", "shared")
    for term in terms:
        assert model.notes[term]
    assert model.breakdown(replicas=2, global_batch=16).allreduce_s > 0
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_a_fit_records_its_prediction_next_to_its_step_time(client, data, calibrated, tmp_path):
    x, y = data
    schedule = dfl.schedule.Stepwise({0: 8, 1: 16})
    result = tiny_pipeline(x, y, schedule=schedule, cost_model=calibrated, window_steps=2).fit(
        epochs=2, client=client
    )
    phases = result.history.phases
    assert len(phases) == 2
    for phase in phases:
        predicted = phase["predicted"]
        assert predicted["replicas"] == phase["replicas"] == 2
        assert predicted["global_batch"] == phase["global_batch"]
        assert predicted["local_batch"] == max(phase["local_batches"])
        assert predicted["step_s"] > 0 and predicted["steps_per_window"] == 2
        assert phase["measured_step_seconds"] > 0
    loaded = dfl.History.from_json(result.history.to_json(tmp_path / "history.json"))
    assert loaded.phases[1]["predicted"] == phases[1]["predicted"]
    # without a cost model the step time is still recorded, and no prediction
    plain = tiny_pipeline(x, y, replicas=1).fit(epochs=1, client=client)
    assert plain.history.phases[0]["measured_step_seconds"] > 0
    assert "predicted" not in plain.history.phases[0]


def test_the_steady_step_time_leaves_out_the_first_windows():
    windows = [(1.0, 1), (2.0, 1), (3.0, 4), (4.0, 4), (5.0, 4)]  # (commit time, steps)
    assert steady_step_seconds(windows) == pytest.approx(2.0 / 8)
    assert steady_step_seconds(windows[:3]) == pytest.approx(1.0 / 4)  # keeps two windows
    assert steady_step_seconds(windows[:1]) is None


def test_a_client_without_workers_is_refused():
    x, y = make_data(32)
    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as empty,
        pytest.raises(ConfigError, match="no workers; start some"),
    ):
        calibrate(tiny_pipeline(x, y), empty)


def test_a_batch_larger_than_the_source_is_refused(client, data):
    x, y = data
    with pytest.raises(BatchSizeError, match="larger than the source"):
        calibrate(tiny_pipeline(x, y), client, batch_sizes=[8, 1000])


def test_a_model_without_trainable_parameters_is_refused(client, data):
    x, y = data

    def frozen():
        model = TinyCNN()
        model.requires_grad_(False)
        return model

    with pytest.raises(ModelError, match="no trainable parameters"):
        calibrate(tiny_pipeline(x, y, model=frozen), client)


class Broken(TinyCNN):
    def forward(self, x):
        raise RuntimeError("this model cannot run")


def test_a_model_whose_step_fails_is_refused(client, data):
    x, y = data
    with pytest.raises(ModelError, match=r"cannot run\. Fix the model") as caught:
        calibrate(tiny_pipeline(x, y, model=Broken), client, **QUICK)
    assert isinstance(caught.value, DataflowError)


def test_a_loss_that_is_not_a_scalar_is_refused(client, data):
    x, y = data

    def per_sample(output, target):
        return torch.nn.functional.cross_entropy(output, target, reduction="none")

    with pytest.raises(LossError, match="not a scalar"):
        calibrate(tiny_pipeline(x, y, loss=per_sample), client, **QUICK)


def test_replicas_sharing_a_node_slow_each_other_as_measured():
    from dataflow.costmodel import ComputeFit, Link, Topology
    from dataflow.costmodel.calibration import _scale_and_offset, fit_alpha_beta

    fit = ComputeFit(points=((8, 0.01), (16, 0.02)), shared=((3, 2.0),))
    assert [fit.slowdown(k) for k in (1, 2, 3, 8)] == [1.0, 1.5, 2.0, 2.0]
    link = Link(latency_s=1e-4, bandwidth=1e9)
    model = CostModel(compute=fit, gradient_bytes=0, topology=Topology(intra=link, per_node=3))
    assert model.breakdown(replicas=1, global_batch=16).compute_s == pytest.approx(0.02)
    assert model.breakdown(replicas=2, global_batch=32).compute_s == pytest.approx(0.03)
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    assert _scale_and_offset([1.0, 3.0], [2.5, 6.5]) == pytest.approx((2.0, 0.5))
    assert _scale_and_offset([1.0, 3.0], [2.0, 3.9]) == pytest.approx((1.0, 0.95))  # constant
    a, b = fit_alpha_beta({4: 1e-4 + 4e-9, 1 << 20: 1e-4 + (1 << 20) * 1e-9})
    assert a == pytest.approx(1e-4) and b == pytest.approx(1e-9)
