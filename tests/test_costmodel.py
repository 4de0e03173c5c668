"""The cost model's terms against their closed forms, their monotonicity, and the
breakdown adding up. Pure: no cluster, milliseconds."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dataflow.core.errors import ConfigError
from dataflow.costmodel import (
    ComputeFit,
    CostModel,
    Link,
    MemoryModel,
    Topology,
    allreduce_seconds,
    best_batch,
    best_replicas,
    bucket_bytes,
    bucket_sizes,
    exposed_allreduce_seconds,
    goodput,
    ring_seconds,
    statistical_efficiency,
    tree_seconds,
    two_level_seconds,
    window_steps,
)

MIB = 1 << 20
NVLINK = Link(latency_s=2e-6, bandwidth=100e9)
NETWORK = Link(latency_s=10e-6, bandwidth=20e9)
NODE8 = Topology(intra=NVLINK, inter=NETWORK, per_node=8)
ONE_NODE = Topology(intra=NVLINK)


def model(**changes) -> CostModel:
    base = CostModel(
        compute=ComputeFit(points=((16, 0.02), (64, 0.05), (256, 0.17))),
        gradient_bytes=100 * MIB,
        topology=NODE8,
        window_overhead_s=2e-3,
    )
    return base.replace(**changes)


# -- the collective's closed forms ------------------------------------------------------


def test_ring_on_one_node_is_the_textbook_form():
    n, w = 64 * MIB, 4
    expected = 2 * (w - 1) * NVLINK.latency_s + 2 * (w - 1) / w * n / NVLINK.bandwidth
    assert ring_seconds(n, w, ONE_NODE) == pytest.approx(expected)


def test_ring_across_nodes_pays_inter_latency_per_node_crossing_and_the_slower_link():
    n, w = 64 * MIB, 32  # 4 nodes of 8
    inter_steps = 2 * (4 - 1)
    latency = (2 * (w - 1) - inter_steps) * NVLINK.latency_s + inter_steps * NETWORK.latency_s
    expected = latency + 2 * (w - 1) / w * n / NETWORK.bandwidth
    assert ring_seconds(n, w, NODE8) == pytest.approx(expected)


def test_tree_pays_log2_nodes_latency_and_half_the_bandwidth():
    n, w = 64 * MIB, 64  # 8 nodes of 8
    latency = 2 * (7 * NVLINK.latency_s + math.log2(8) * NETWORK.latency_s)
    assert tree_seconds(n, w, NODE8) == pytest.approx(latency + 2 * n / NETWORK.bandwidth)


def test_two_level_is_an_intra_ring_plus_an_inter_ring_of_the_nodes():
    n, w = 64 * MIB, 64
    inside = 2 * 7 * NVLINK.latency_s + 2 * 7 / 8 * n / NVLINK.bandwidth
    between = 2 * 7 * NETWORK.latency_s + 2 * 7 / 8 * n / NETWORK.bandwidth
    assert two_level_seconds(n, w, NODE8) == pytest.approx(inside + between)


def test_best_is_the_fastest_algorithm_and_small_messages_prefer_the_tree():
    w = 1024
    for n in (4096, 64 * MIB):
        each = [f(n, w, NODE8) for f in (ring_seconds, tree_seconds, two_level_seconds)]
        assert allreduce_seconds(n, w, NODE8) == min(each)
    assert tree_seconds(4096, w, NODE8) < ring_seconds(4096, w, NODE8)
    assert ring_seconds(256 * MIB, 16, NODE8) < tree_seconds(256 * MIB, 16, NODE8)


def test_one_replica_or_no_bytes_cost_nothing():
    for f in (ring_seconds, tree_seconds, two_level_seconds, allreduce_seconds):
        assert f(MIB, 1, NODE8) == 0.0
        assert f(0, 8, NODE8) == 0.0


@pytest.mark.parametrize("algorithm", ["ring", "tree", "two_level", "best"])
def test_allreduce_time_grows_with_bytes_and_replicas(algorithm):
    sizes = [2**k for k in range(10, 30, 3)]
    times = [allreduce_seconds(n, 64, NODE8, algorithm) for n in sizes]
    assert times == sorted(times) and times[0] < times[-1]
    counts = [2, 4, 8, 16, 64, 256, 1024]
    times = [allreduce_seconds(MIB, w, NODE8, algorithm) for w in counts]
    assert times == sorted(times)


def test_several_nodes_without_an_inter_link_is_refused():
    with pytest.raises(ConfigError, match="inter"):
        ring_seconds(MIB, 16, Topology(intra=NVLINK, per_node=8))


def test_bad_links_and_topologies_name_the_field():
    with pytest.raises(ConfigError, match="bandwidth"):
        Link(latency_s=1e-6, bandwidth=0)
    with pytest.raises(ConfigError, match="latency_s"):
        Link(latency_s=-1, bandwidth=1e9)
    with pytest.raises(ConfigError, match="algorithm"):
        Topology(intra=NVLINK, algorithm="butterfly")
    with pytest.raises(ConfigError, match="per_node"):
        Topology(intra=NVLINK, per_node=0)


# -- buckets and overlap ------------------------------------------------------------------


def test_buckets_hold_every_byte_and_the_first_is_small():
    sizes = bucket_sizes(100 * MIB, 25 * MIB, MIB)
    assert sum(sizes) == 100 * MIB
    assert sizes[0] == MIB and max(sizes) == 25 * MIB
    assert bucket_sizes(0, 25 * MIB) == []


def test_exposed_is_the_total_without_overlap_and_the_total_is_the_sum_of_buckets():
    buckets = bucket_sizes(100 * MIB, 25 * MIB, MIB)
    each = sum(allreduce_seconds(b, 64, NODE8) for b in buckets)
    total, exposed = exposed_allreduce_seconds(buckets, 64, NODE8, backward_s=1.0, overlap=0.0)
    assert total == pytest.approx(each) and exposed == pytest.approx(each)


def test_a_long_backward_hides_all_but_the_last_bucket():
    buckets = bucket_sizes(100 * MIB, 25 * MIB, MIB)
    total, exposed = exposed_allreduce_seconds(buckets, 64, NODE8, backward_s=100.0)
    assert exposed == pytest.approx(allreduce_seconds(buckets[-1], 64, NODE8))
    assert exposed < total


def test_exposed_shrinks_as_backward_grows():
    buckets = bucket_sizes(100 * MIB, 8 * MIB, MIB)
    exposed = [
        exposed_allreduce_seconds(buckets, 64, NODE8, backward_s=b)[1]
        for b in (0.0, 0.005, 0.01, 0.02, 0.05)
    ]
    assert exposed == sorted(exposed, reverse=True) and exposed[0] > exposed[-1]


# -- compute and memory -----------------------------------------------------------------


def test_compute_follows_the_measurements_and_extrapolates_linearly():
    fit = ComputeFit(points=((64, 0.05), (16, 0.02), (256, 0.17)))
    assert fit.points[0] == (16, 0.02)  # sorted
    assert fit.seconds(64) == pytest.approx(0.05)
    assert fit.seconds(40) == pytest.approx(0.02 + 0.03 * 24 / 48)
    assert fit.seconds(512) == pytest.approx(0.17 + (0.12 / 192) * 256)
    assert fit.seconds(0) == 0.0
    values = [fit.seconds(b) for b in range(1, 1000, 7)]
    assert values == sorted(values) and min(values) > 0


def test_throughput_preset_and_micro_batches():
    fit = ComputeFit.from_throughput(1000.0, batch=64)
    assert fit.seconds(64) == pytest.approx(0.064)
    seconds, count = fit.micro_batched_seconds(100, 32)
    assert count == 4 and seconds == pytest.approx(0.1)
    assert fit.micro_batched_seconds(20, 32) == (pytest.approx(0.02), 1)


def test_bad_compute_points_are_named():
    with pytest.raises(ConfigError, match="repeat"):
        ComputeFit(points=((8, 0.1), (8, 0.2)))
    with pytest.raises(ConfigError, match="seconds"):
        ComputeFit(points=((8, -1.0),))
    with pytest.raises(ConfigError, match="at least one"):
        ComputeFit(points=())


def test_memory_breakdown_adds_up_and_grows_with_the_micro_batch():
    m = model(memory=MemoryModel(parameter_bytes=100, activation_bytes_per_sample=10,
                                 optimizer_states=2), max_micro_batch=32)  # fmt: skip
    small = m.memory_bytes(replicas=4, global_batch=64)
    large = m.memory_bytes(replicas=1, global_batch=64)
    assert small["total"] == sum(v for k, v in small.items() if k != "total")
    assert small["activations"] == 160 and large["activations"] == 320  # capped at 32
    assert small["optimizer"] == 200
    with pytest.raises(ConfigError, match="memory"):
        model().memory_bytes(replicas=1, global_batch=8)


# -- the step and its breakdown ---------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 8, 64, 1024])
def test_breakdown_adds_up_to_the_step(replicas):
    step = model(load_samples_per_s=500.0).breakdown(replicas=replicas, global_batch=64 * replicas)
    assert step.step_s == pytest.approx(
        step.compute_s + step.data_wait_s + step.allreduce_exposed_s + step.overhead_s
    )
    synced = model(batchnorm_channels=(8,)).breakdown(replicas=replicas, global_batch=64)
    assert synced.step_s == pytest.approx(
        synced.compute_s + synced.data_wait_s + synced.allreduce_exposed_s
        + synced.batchnorm_s + synced.overhead_s
    )  # fmt: skip
    assert step.samples_per_second == pytest.approx(64 * replicas / step.step_s)
    assert 0 <= step.allreduce_exposed_s <= step.allreduce_s
    as_dict = step.to_dict()
    assert json.loads(json.dumps(as_dict))["step_s"] == pytest.approx(step.step_s)


def test_a_slow_source_shows_as_data_wait():
    step = model(load_samples_per_s=100.0).breakdown(replicas=1, global_batch=64)
    assert step.data_wait_s == pytest.approx(0.64 - 0.05)
    assert model().breakdown(replicas=1, global_batch=64).data_wait_s == 0.0


def test_window_overhead_is_shared_by_the_steps_of_a_window():
    fixed = model(window_steps=4).breakdown(replicas=1, global_batch=64)
    assert fixed.overhead_s == pytest.approx(2e-3 / 4) and fixed.steps_per_window == 4
    timed = model(window_seconds=1.0).breakdown(replicas=1, global_batch=64)
    assert timed.steps_per_window == math.ceil(1.0 / 0.05)


def test_uneven_split_costs_the_largest_share():
    m = model()
    even = m.breakdown(replicas=2, global_batch=128)
    uneven = m.breakdown(replicas=2, global_batch=128, local_batches=[96, 32])
    assert uneven.local_batch == 96 and uneven.compute_s > even.compute_s
    with pytest.raises(ConfigError, match="local_batches"):
        m.breakdown(replicas=2, global_batch=128, local_batches=[64, 32])


def test_weak_scaling_efficiency_is_one_alone_and_falls_with_replicas():
    m = model()
    assert m.efficiency(replicas=1, local_batch=64) == pytest.approx(1.0)
    eff = [m.efficiency(replicas=w, local_batch=64) for w in (1, 8, 64, 512, 4096)]
    assert eff == sorted(eff, reverse=True) and all(0 < e <= 1 for e in eff)
    assert m.efficiency(replicas=8, global_batch=512) == m.efficiency(replicas=8, local_batch=64)
    with pytest.raises(ConfigError, match="exactly one"):
        m.efficiency(replicas=8)


def test_larger_local_batches_scale_better():
    m = model()
    assert m.efficiency(replicas=256, local_batch=256) > m.efficiency(replicas=256, local_batch=16)


def test_schedule_efficiency_between_its_phases_and_phase_overhead_costs():
    m = model()
    phases = [(16 * 64, 100_000), (64 * 64, 100_000), (256 * 64, 100_000)]
    result = m.schedule_efficiency(replicas=64, phases=phases)
    per_phase = [m.efficiency(replicas=64, global_batch=b) for b, _ in phases]
    assert min(per_phase) <= result["efficiency"] <= max(per_phase)
    slower = m.replace(phase_overhead_s=10.0).schedule_efficiency(replicas=64, phases=phases)
    assert slower["efficiency"] < result["efficiency"]


def test_bad_counts_are_named():
    with pytest.raises(ConfigError, match="replicas"):
        model().breakdown(replicas=0, global_batch=8)
    with pytest.raises(ConfigError, match="global_batch"):
        model().step_seconds(replicas=1, global_batch=1.5)


def test_sync_batchnorm_adds_two_reductions_per_layer_and_micro_batch_on_the_step():
    """Per BatchNorm layer and micro-batch: the moments' sums (2C float64) and the
    adjoint's (2C float32), both on the compute path; none alone."""
    synced = model(batchnorm_channels=(16, 64), max_micro_batch=32)
    assert synced.breakdown(replicas=1, global_batch=64).batchnorm_s == 0.0
    step = synced.breakdown(replicas=8, global_batch=8 * 64)  # 2 micro-batches of 32
    layers = [
        allreduce_seconds(16 * c, 8, NODE8) + allreduce_seconds(8 * c, 8, NODE8) for c in (16, 64)
    ]
    assert step.micro_batches == 2
    assert step.batchnorm_s == pytest.approx(2 * sum(layers)) and step.batchnorm_s > 0
    plain = model(max_micro_batch=32).breakdown(replicas=8, global_batch=8 * 64)
    assert plain.batchnorm_s == 0.0
    assert step.step_s == pytest.approx(plain.step_s + step.batchnorm_s, rel=1e-3)  # (windows)
    with pytest.raises(ConfigError, match="batchnorm_channels"):
        model(batchnorm_channels=(0,))


def test_a_model_saves_and_loads(tmp_path):
    m = model(
        memory=MemoryModel(parameter_bytes=8, activation_bytes_per_sample=4),
        notes={"a": "b"},
        batchnorm_channels=(4, 8),
    )
    back = CostModel.load(m.save(tmp_path / "model.json"))
    assert back == m
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"CostModel\.save"):
        CostModel.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no cost model file"):
        CostModel.load(tmp_path / "missing.json")


# -- planning ---------------------------------------------------------------------------


def test_statistical_efficiency_is_pollux():
    assert statistical_efficiency(32, 100.0, 32) == 1.0
    assert statistical_efficiency(132, 100.0, 32) == pytest.approx(132 / 232)
    assert statistical_efficiency(4096, None, 32) == 1.0
    values = [statistical_efficiency(b, 500.0, 32) for b in (32, 64, 256, 4096)]
    assert values == sorted(values, reverse=True)


def test_goodput_has_an_optimum_batch_on_fixed_replicas():
    m = model()
    sizes = [64 * 2**k for k in range(0, 8)]
    choice, table = best_batch(m, replicas=8, candidates=sizes, noise_scale=1000.0, base_batch=64)
    assert sizes[0] < choice < sizes[-1]
    g = dict(table)
    assert g[choice] == pytest.approx(
        goodput(m, replicas=8, global_batch=choice, noise_scale=1000.0, base_batch=64)
    )


def test_best_replicas_stops_where_more_workers_stop_paying():
    m = model()
    choice, table = best_replicas(m, global_batch=512, max_replicas=64)
    rates = dict(table)
    assert rates[choice] >= 0.98 * max(rates.values())
    assert all(rates[w] < 0.98 * max(rates.values()) for w in rates if w < choice)
    slow_network = m.replace(
        topology=Topology(intra=Link(latency_s=1e-3, bandwidth=1e8), per_node=1,
                          inter=Link(latency_s=1e-3, bandwidth=1e8))
    )  # fmt: skip
    assert best_replicas(slow_network, global_batch=512, max_replicas=64)[0] == 1
    assert best_replicas(m, global_batch=4, max_replicas=64)[0] <= 4


def test_window_steps_keep_the_overhead_under_the_fraction():
    m = model()
    steps = window_steps(m, replicas=8, global_batch=512, overhead_fraction=0.01)
    step = m.replace(window_steps=steps).breakdown(replicas=8, global_batch=512)
    assert step.overhead_s / step.step_s <= 0.01
    fewer = m.replace(window_steps=steps - 1).breakdown(replicas=8, global_batch=512)
    assert fewer.overhead_s / fewer.step_s > 0.01 or steps == 1
    assert window_steps(m.replace(window_overhead_s=0.0), replicas=8, global_batch=512) == 1


def test_bucket_size_minimises_the_exposed_allreduce():
    m = model()
    choice, table = bucket_bytes(m, replicas=64, global_batch=4096)
    assert dict(table)[choice] == min(t for _, t in table)
    assert choice in dict(table)


def test_prediction_imports_neither_torch_nor_dask():
    """Nor does the calibration module at import (it imports them inside functions)."""
    code = (
        "import sys, dataflow.costmodel as cm, dataflow.costmodel.calibration; "
        "cm.CostModel(compute=cm.ComputeFit(points=((1, 1.0),)), gradient_bytes=1, "
        "topology=cm.Topology(intra=cm.Link(latency_s=0, bandwidth=1))).step_seconds("
        "replicas=2, global_batch=2); "
        "print(sorted(m for m in ('torch', 'distributed', 'dask', 'numba') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_one_node_calibration_predicts_beyond_the_node_once_given_a_network():
    calibrated = model(topology=Topology(intra=NVLINK, per_node=2))
    with pytest.raises(ConfigError, match=r"model\.with_network"):
        calibrated.step_seconds(replicas=64, global_batch=4096)
    joined = calibrated.with_network(NETWORK)
    assert joined.topology.per_node == 2 and joined.topology.inter == NETWORK
    assert "inter" in joined.notes
    many = joined.breakdown(replicas=64, global_batch=4096)
    assert many.allreduce_s == pytest.approx(
        sum(
            allreduce_seconds(b, 64, joined.topology)
            for b in bucket_sizes(joined.gradient_bytes, joined.bucket_bytes, MIB)
        )
    )
    assert joined.with_network(NETWORK, per_node=8).topology.per_node == 8
    # a slower network costs more
    slow = calibrated.with_network(Link(latency_s=1e-4, bandwidth=1e9))
    assert slow.step_seconds(replicas=64, global_batch=4096) > many.step_s
