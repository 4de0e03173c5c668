"""Presets from published constants and the scaling tables built on them (pure, no cluster)."""

import itertools
import math

import pytest

from dataflow.core.errors import ConfigError
from dataflow.costmodel import presets, scaling
from dataflow.costmodel.collective import Link, Topology


@pytest.mark.parametrize("name", sorted(presets.MODELS))
def test_every_model_preset_builds(name):
    model = presets.model(name)
    assert model.gradient_bytes > 0
    assert model.topology.inter is not None
    local = int(model.notes["local_batch"])
    assert model.throughput(replicas=8, global_batch=8 * local) > 0
    for term in ("compute", "gradient_bytes", "intra", "inter", "node"):
        assert model.notes[term], term


@pytest.mark.parametrize("name", sorted(presets.INTERCONNECTS))
def test_every_interconnect_builds_with_a_source(name):
    link = presets.interconnect(name)
    assert isinstance(link, Link)
    assert link.bandwidth > 1e9 and 0 < link.latency_s < 1e-4
    assert "nccl" in link.source.lower()  # latency from NCCL's tuning.cc


def test_every_constant_has_a_source():
    rows = presets.sources()
    assert len(rows) >= len(presets.INTERCONNECTS) + len(presets.NETWORKS) + len(presets.DEVICES)
    for kind, name, source in rows:
        assert len(source) > 20, (kind, name, source)
    assert "v2.30.7-1" in presets.NCCL


def test_nccl_latency_constants_are_the_files():
    # NVIDIA/nccl v2.30.7-1 src/graph/tuning.cc hwLatencies[...][Ring][Simple]
    latencies = (presets.NVLINK_LATENCY_S, presets.PCI_LATENCY_S, presets.NET_LATENCY_S)
    assert latencies == pytest.approx((3.4e-6, 5.7e-6, 14.0e-6))


def test_gradient_sizes():
    assert presets.model("resnet50-v100-edr").gradient_bytes == 25_557_032 * 4
    assert presets.model("resnet50-v100-edr", gradients="fp16").gradient_bytes == 25_557_032 * 2
    assert presets.network("resnet101").parameters == 44_549_160
    assert presets.network("inception_v3").parameters == 23_851_784


def test_cluster_sums_the_nics_and_fills_from_the_device():
    topo = presets.cluster(device="a100")
    assert isinstance(topo, Topology)
    assert topo.per_node == 8
    assert topo.inter.bandwidth == pytest.approx(8 * presets.interconnect("ib-hdr").bandwidth)
    two = presets.cluster(intra="pcie3", inter="eth-25g", per_node=4, nics=2)
    assert two.inter.bandwidth == pytest.approx(2 * presets.interconnect("eth-25g").bandwidth)


@pytest.mark.parametrize(
    ("call", "valid"),
    [
        (lambda: presets.model("resnet50-h10"), "resnet50-h100-ndr"),
        (lambda: presets.interconnect("ib-hdrr"), "ib-hdr"),
        (lambda: presets.device("k80"), "v100"),
        (lambda: presets.network("vgg16"), "resnet50"),
    ],
)
def test_unknown_names_raise_config_error_naming_the_valid_ones(call, valid):
    with pytest.raises(ConfigError) as info:
        call()
    assert valid in str(info.value)
    assert "valid names" in str(info.value)


def test_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'resnet50-h100-ndr'"):
        presets.model("resnet50-h100-nd")


def test_unknown_override_and_missing_throughput():
    with pytest.raises(ConfigError, match="unknown override"):
        presets.model("resnet50-h100-ndr", nodes=3)
    with pytest.raises(ConfigError, match="no published throughput"):
        presets.model("resnet50-h100-ndr", precision="fp32")


def test_names_lists_every_kind():
    listed = presets.names()
    assert set(listed) == {"models", "devices", "interconnects", "networks"}
    assert "resnet50-h100-ndr" in listed["models"]


def test_worker_counts():
    counts = scaling.worker_counts(4096)
    assert counts[0] == 1 and counts[-1] == 4096 and len(counts) == 13
    assert 352 in scaling.worker_counts(4096, extra=[352])
    with pytest.raises(ConfigError):
        scaling.worker_counts(0)


@pytest.mark.parametrize("name", sorted(presets.MODELS))
def test_weak_scaling_is_one_at_one_worker_and_never_above(name):
    model = presets.model(name)
    rows = scaling.weak_scaling(model, local_batch=int(model.notes["local_batch"]))
    assert [r.replicas for r in rows] == scaling.worker_counts(4096)
    assert rows[0].efficiency == pytest.approx(1.0)
    assert all(r.efficiency <= 1 + 1e-12 for r in rows)
    assert all(r.global_batch == r.local_batch * r.replicas for r in rows)


@pytest.mark.parametrize("name", sorted(presets.MODELS))
def test_ring_efficiency_never_rises_beyond_one_node(name):
    model = presets.model(name, algorithm="ring")
    rows = scaling.weak_scaling(model, local_batch=int(model.notes["local_batch"]))
    beyond = [r.efficiency for r in rows if r.replicas >= model.topology.per_node]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(beyond))


def test_the_terms_add_up():
    model = presets.model("resnet50-h100-ndr")
    for row in scaling.weak_scaling(model, local_batch=256):
        parts = row.compute_s + row.data_wait_s + row.allreduce_exposed_s + row.overhead_s
        assert row.step_s == pytest.approx(parts)
        assert row.samples_per_second == pytest.approx(row.global_batch / row.step_s)
        assert row.allreduce_exposed_s <= row.allreduce_s + 1e-15
    print(scaling.format_rows(scaling.weak_scaling(model, local_batch=256)))


def test_schedule_scaling():
    model = presets.model("resnet50-v100-edr")
    phases = scaling.stepwise_phases("0:256,30:1024,60:4096", epochs=90)
    assert phases == [(b, 30 * scaling.IMAGENET_TRAIN) for b in (256, 1024, 4096)]
    rows = scaling.schedule_scaling(model, phases=phases)
    assert rows[0].replicas == 1 and rows[0].efficiency == pytest.approx(1.0)
    assert rows[-1].replicas == 256  # no count above the smallest phase batch
    assert all(r.efficiency <= 1 + 1e-12 for r in rows)
    adaptive = scaling.adaptive_phases(256, 4096, epochs=90)
    assert [b for b, _ in adaptive] == [256, 512, 1024, 2048, 4096]


@pytest.mark.parametrize("text", ["30:1024", "0-256", "0:x", ""])
def test_bad_stepwise_text(text):
    with pytest.raises(ConfigError):
        scaling.parse_stepwise(text)


def test_published_reproductions_stay_within_their_tolerance():
    rows = scaling.published()
    assert {r.key.split("-")[0] for r in rows} == {"horovod", "goyal", "hu2022"}
    for row in rows:
        assert row.within_tolerance, (row.key, row.difference_points)
        assert row.tolerance_points <= 7
        assert 0 < row.predicted <= 1
        assert row.reasons and row.lacks and row.paper
        assert math.isclose(row.difference_points, 100 * (row.predicted - row.published))
    text = scaling.format_published(rows)
    print(text)
    assert "horovod-resnet101" in text and "goyal-resnet50" in text and "hu2022" in text


def test_published_terms_add_up():
    for row in scaling.published():
        for terms in row.terms.values():
            parts = (
                terms["compute_s"]
                + terms["data_wait_s"]
                + terms["allreduce_exposed_s"]
                + terms["overhead_s"]
            )
            assert terms["step_s"] == pytest.approx(parts)


def test_pure_modules_do_not_import_matplotlib_or_torch():
    import subprocess
    import sys

    code = (
        "import sys; import dataflow.costmodel.presets, dataflow.costmodel.scaling, "
        "dataflow.costmodel.plot; bad = [m for m in ('torch', 'matplotlib', 'distributed') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
