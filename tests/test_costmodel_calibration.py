"""Calibration on a real LocalCluster (two single-threaded worker processes): every term
is measured and explained, a fit with ``cost_model=`` records its prediction next to its
steady step time, and bad input is refused with the fix. No timing is asserted: only
that each term was measured, and what its shape must be."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from conftest import TinyCNN, make_data, tiny_pipeline
from distributed import Client, LocalCluster

import dataflow as dfl
from dataflow.costmodel import CostModel, calibrate
from dataflow.driver.step_times import plausible_step_seconds, steady_step_seconds
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
    # each of the three batches spanning 16/2 .. 16 measured, or discarded with why (the
    # screening itself is tested on given samples: test_costmodel_screening.py)
    dropped = {d["batch"] for d in model.discarded if d["action"] == "discarded"}
    assert batches == sorted(set(batches)) and set(batches) | dropped == {8, 11, 16}
    assert all(d["reason"] for d in model.discarded) and model.notes["discarded"]
    assert "timing sample(s) used" in model.notes["compute"]
    assert model.notes["samples_per_epoch"] == "160"
    assert 0 < model.compute.backward_fraction < 1
    link = model.topology.intra
    assert link.latency_s > 0 and link.bandwidth > 0 and link.source.startswith("calibrated")
    assert model.topology.per_node == 2 and model.topology.inter is None  # one machine
    assert model.compute.shared[0][0] == 2 and model.compute.shared[0][1] >= 1
    assert model.sync_overhead_s >= 0 and model.notes["sync_overhead_s"]
    assert model.window_overhead_s > 0 and model.phase_overhead_s > 0
    assert model.load_samples_per_s > 0
    params = sum(p.numel() * 4 for p in TinyCNN().parameters())
    assert model.gradient_bytes == params and model.memory.parameter_bytes == params
    assert model.memory.optimizer_states == 1  # SGD's momentum buffer
    assert model.memory.activation_bytes_per_sample > 0
    assert model.batchnorm_channels == ()  # no sync_batchnorm
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
        if "measured_step_note" in phase:  # the steady one was implausible: the median
            steps = [s["seconds"] for s in result.history.steps if s["phase"] == phase["phase"]]
            assert phase["measured_step_seconds"] == pytest.approx(statistics.median(steps))
    loaded = dfl.History.from_json(result.history.to_json(tmp_path / "history.json"))
    assert loaded.phases[1]["predicted"] == phases[1]["predicted"]
    # without a cost model the step time is still recorded, and no prediction
    plain = tiny_pipeline(x, y, replicas=1).fit(epochs=1, client=client)
    assert plain.history.phases[0]["measured_step_seconds"] > 0
    assert "predicted" not in plain.history.phases[0]


def test_with_sync_batchnorm_the_model_lists_each_batchnorm_layers_channels():
    """What the batchnorm term needs, from the model built on the driver; the
    synchronous steps' fitted offset is what they take beyond both reductions."""
    from test_sync_batchnorm import BatchNormCNN

    from dataflow.costmodel.calibration import _parameters

    x, y = make_data(32)
    synced = tiny_pipeline(x, y, model=BatchNormCNN, sync_batchnorm=True)
    assert _parameters(synced.trainer)[2] == (4, 4)
    assert _parameters(tiny_pipeline(x, y, model=BatchNormCNN).trainer)[2] == ()


def test_the_steady_step_time_leaves_out_the_first_windows():
    windows = [(1.0, 1), (2.0, 1), (3.0, 4), (4.0, 4), (5.0, 4)]  # (commit time, steps)
    assert steady_step_seconds(windows) == pytest.approx(2.0 / 8)
    assert steady_step_seconds(windows[:3]) == pytest.approx(1.0 / 4)  # keeps two windows
    assert steady_step_seconds(windows[:1]) is None
    # the recorded case: the first fused windows committed 3 ms apart (the driver took both
    # at once), 26 steps each of ~38 ms: counted from the first, 24 ms a step
    bunched = [(0.5, 1), (0.6, 1), (2.049, 26), (2.052, 26), (3.04, 26), (4.03, 26)]
    naive = steady_step_seconds(bunched)
    assert naive == pytest.approx((4.03 - 2.049) / 78)  # 25 ms: the window's time lost
    assert steady_step_seconds(bunched, step_median=0.038) == pytest.approx((4.03 - 2.052) / 52)
    assert steady_step_seconds(windows, step_median=0.25) == pytest.approx(2.0 / 8)  # spaced


def test_an_implausible_steady_step_is_discarded_and_said():
    """Windows the driver committed together once gave 0.95 ms a step where the replicas
    ran 21 ms ones: the median step is recorded instead, with why."""
    steps = [0.021, 0.0205, 0.0215, 0.021]
    assert plausible_step_seconds(0.022, steps) == (0.022, None)
    measured, note = plausible_step_seconds(0.00095, steps)
    assert measured == pytest.approx(0.021) and "implausible, discarded" in note
    assert "0.00095 s a step" in note and "median step of 0.021 s" in note
    assert plausible_step_seconds(None, steps) == (pytest.approx(0.021), None)
    assert plausible_step_seconds(None, []) == (None, None)


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
    from dataflow.costmodel.calibration import _scale_and_offset
    from dataflow.costmodel.link_calibration import fit_alpha_beta

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
