"""The layout model (issue 16, item 6): halo traffic from the real partition's geometry,
memory per worker, the ranking of sample, spatial and hybrid layouts, and the refusal
that names the smallest spatial group. Pure: no torch, milliseconds."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from dataflow.core.errors import ConfigError
from dataflow.costmodel.collective import Link, Topology
from dataflow.costmodel.layout_cost import (
    LayerFit,
    LayerShape,
    LayoutCandidate,
    LayoutModel,
    SavedCopies,
    candidates,
    expected_max_excess,
    format_table,
)
from dataflow.spatial.geometry import Window, clip, exchange, halo_rows, split_extent

CONV = Window(3, 1, 1, 1, 1)
POOL = Window(2, 2)
FAST = Link(latency_s=2e-6, bandwidth=100e9)
SLOW = Link(latency_s=1e-3, bandwidth=50e6)
MIB = 1 << 20


def conv_stack(
    side: int = 64, blocks: int = 3, width: int = 8, channels: int = 1
) -> list[LayerShape]:
    """conv + BatchNorm + ReLU + maxpool blocks on a cube, then flatten and a linear."""
    layers, c, s = [], channels, side
    for i in range(blocks):
        w = width * 2**i
        cube, half = (s, s, s), (s // 2,) * 3
        layers += [
            LayerShape(name=f"conv{i}", kind="conv", in_shape=(c, *cube), out_shape=(w, *cube),
                       windows=(CONV,) * 3, params=c * w * 27 + w),
            LayerShape(name=f"bn{i}", kind="norm", in_shape=(w, *cube), out_shape=(w, *cube),
                       params=2 * w),
            LayerShape(name=f"relu{i}", kind="pointwise", in_shape=(w, *cube),
                       out_shape=(w, *cube)),
            LayerShape(name=f"pool{i}", kind="pool", variant="max", in_shape=(w, *cube),
                       out_shape=(w, *half), windows=(POOL,) * 3),
        ]  # fmt: skip
        c, s = w, s // 2
    flat = c * s**3
    layers += [
        LayerShape(name="gather", kind="gather", in_shape=(c, s, s, s), out_shape=(c, s, s, s)),
        LayerShape(name="flat", kind="pointwise", variant="view", in_shape=(c, s, s, s),
                   out_shape=(flat,)),
        LayerShape(name="fc", kind="dense", in_shape=(flat,), out_shape=(4,), params=flat * 4 + 4),
    ]  # fmt: skip
    return layers


def model(layers=None, link=FAST, **kw) -> LayoutModel:  # type: ignore[no-untyped-def]
    layers = layers or conv_stack()
    fits = {x.name: LayerFit(fixed_s=0.0, per_voxel_s=1e-8) for x in layers}
    return LayoutModel(layers=tuple(layers), fits=fits, topology=Topology(intra=link), **kw)


def spatial(p: int, dims=(0,), grid=None, groups=1) -> LayoutCandidate:  # type: ignore[no-untyped-def]
    return LayoutCandidate(groups=groups, spatial=p, dims=dims, grid=grid or (p,))


SAMPLE = LayoutCandidate(groups=1)


# -- geometry: surface over volume ------------------------------------------------------


def test_doubling_p_doubles_the_halo_and_halves_the_compute():
    m = model()
    two, four = (m.predict(spatial(p), global_batch=1) for p in (2, 4))
    # an edge rank of 2 exchanges one face; a middle rank of 4 exchanges two
    assert 1.8 <= four.halo_bytes / two.halo_bytes <= 2.2
    assert 0.45 <= four.compute_s / two.compute_s <= 0.55
    # summed over the ranks, halo rows grow as P - 1
    chain = [(CONV, 64), (CONV, 32), (CONV, 16)]
    assert halo_rows(chain, 4) == 3 * halo_rows(chain, 2)


def test_halo_bytes_are_the_partitions_rows():
    """The slowest rank's received bytes equal what ``exchange`` gives for each layer."""
    m = model()
    got = m.predict(spatial(4), global_batch=3).halo_bytes
    expected = 0
    for x in m.layers:
        if x.kind not in ("conv", "pool"):
            continue
        n_in, n_out = x.in_shape[1], x.out_shape[1]
        owned, outs = split_extent(n_in, 4), split_extent(n_out, 4)
        needs = [clip(x.windows[0].needed(o), n_in) for o in outs]
        rows = sum(hi - lo for _, (lo, hi) in exchange(1, owned, needs).recvs)  # a middle rank
        expected += rows * x.in_shape[0] * x.in_shape[2] * x.in_shape[3] * 3 * 4
    assert got == expected


def test_a_sample_layout_moves_no_halo_and_gathers_nothing():
    p = model().predict(LayoutCandidate(groups=4), global_batch=8)
    assert p.halo_s == p.halo_exposed_s == p.gather_s == p.reduce_s == 0.0
    assert p.local_batch == 2 and p.allreduce_s > 0
    terms = p.compute_s + p.allreduce_exposed_s + p.fixed_s
    assert math.isclose(p.step_s, terms)


def test_the_step_adds_up_and_the_halo_hides_behind_the_interior():
    p = model(link=SLOW).predict(spatial(2), global_batch=1)
    assert p.halo_exposed_s < p.halo_s
    total = p.compute_s + p.halo_exposed_s + p.gather_s + p.reduce_s + p.allreduce_exposed_s
    assert math.isclose(p.step_s, total)
    assert p.to_dict()["layout"] == "spatial 1x2 dims 0 (2)"


def test_the_expected_maximum_of_p_draws():
    """Tabulated expected maxima of standard normals: 0.5642, 0.8463, 1.0294, 1.4236."""
    assert expected_max_excess(1) == 0.0
    for draws, table in ((2, 0.5642), (3, 0.8463), (4, 1.0294), (8, 1.4236)):
        assert math.isclose(expected_max_excess(draws), table, rel_tol=0.03), draws


def test_the_wait_for_the_slowest_rank_grows_with_the_group():
    """No spread, no wait; with a spread, a group of P waits c_P x jitter x compute, and
    the groups wait once more at the gradients' allreduce (less: the noise of a whole
    step averages over its layers)."""
    assert model().predict(spatial(2), global_batch=1).sync_s == 0.0
    m = model(jitter=0.1)
    assert m.predict(SAMPLE, global_batch=1).sync_s == 0.0  # one worker waits for nobody
    two, four = (m.predict(spatial(p), global_batch=1) for p in (2, 4))
    assert math.isclose(two.sync_s, 0.1 * expected_max_excess(2) * two.compute_s)
    assert four.sync_s / four.compute_s > two.sync_s / two.compute_s
    groups = m.predict(LayoutCandidate(groups=2), global_batch=2)
    assert 0 < groups.sync_s < 0.1 * expected_max_excess(2) * groups.compute_s
    assert math.isclose(
        groups.step_s,
        groups.compute_s + groups.allreduce_exposed_s + groups.fixed_s + groups.sync_s,
    )


def test_a_measured_sync_overhead_replaces_the_wait_across_groups():
    """``CostModel.sync_overhead_s`` (measured on real steps) is paid once per step by
    any layout of more than one worker, and never by one worker alone."""
    m = model(jitter=0.1, sync_overhead_s=0.004)
    assert m.predict(SAMPLE, global_batch=1).sync_s == 0.0
    groups = m.predict(LayoutCandidate(groups=2), global_batch=2)
    assert math.isclose(groups.sync_s, 0.004)
    two = m.predict(spatial(2), global_batch=1)
    assert math.isclose(two.sync_s, 0.004 + 0.1 * expected_max_excess(2) * two.compute_s)


def test_batchnorm_statistics_cost_one_collective_each_way():
    """Forward: every rank's count, sums and squared deviations in one allreduce;
    backward: the two gradient sums in one. A slow link's latency counts twice per
    BatchNorm layer (plus the shape agreement once), not four times."""
    latency_only = Link(latency_s=1e-3, bandwidth=1e15)
    layers = [x for x in conv_stack() if x.kind in ("conv", "norm")][:2]
    p = model(layers=layers, link=latency_only).predict(spatial(2), global_batch=1)
    one = model(layers=layers[:1], link=latency_only).predict(spatial(2), global_batch=1)
    assert math.isclose(p.reduce_s - one.reduce_s, 2 * one.reduce_s, rel_tol=1e-6)


# -- memory -----------------------------------------------------------------------------


def test_memory_per_worker_falls_as_one_over_p_for_a_conv_stack():
    m = model()
    act = {p: m.memory_bytes(spatial(p), local_batch=1)["activations"] for p in (2, 4, 8)}
    act[1] = m.memory_bytes(SAMPLE, local_batch=1)["activations"]
    for p in (1, 2, 4):
        assert 0.45 <= act[2 * p] / act[p] <= 0.6, (p, act)
    # layers keeping two copies of each region (an earlier SpatialBatchNorm, the whole
    # halo'd input of each conv) would keep far more than half
    copies = m.replace(saved=SavedCopies(norm_region=2.0, halo_copy=True, edge_pad_copy=True))
    assert copies.memory_bytes(spatial(2), local_batch=1)["activations"] >= 0.7 * act[1]


def test_memory_counts_parameters_and_grows_with_the_local_batch():
    m = model(optimizer_states=2)
    one = m.memory_bytes(SAMPLE, local_batch=1)
    four = m.memory_bytes(SAMPLE, local_batch=4)
    assert four["activations"] == 4 * one["activations"]
    assert one["optimizer"] == 2 * one["weights"] == 2 * m.parameter_bytes
    assert one["total"] == sum(v for k, v in one.items() if k != "total")
    micro = m.replace(max_micro_batch=1).predict(SAMPLE, global_batch=4)
    assert micro.memory == one and micro.micro_batches == 4


def test_a_pair_of_dims_keeps_about_what_one_dim_does():
    m = model()
    one_dim = m.memory_bytes(spatial(4), local_batch=1)["total"]
    two_dims = m.memory_bytes(spatial(4, dims=(0, 1), grid=(2, 2)), local_batch=1)["total"]
    assert 0.8 <= two_dims / one_dim <= 1.25


# -- candidates and the choice ------------------------------------------------------------


def test_candidates_enumerate_sample_spatial_and_hybrid():
    layers = conv_stack()
    four = candidates(4, layers)
    assert [c.describe() for c in four[:4]] == [
        "sample 4x1",
        "hybrid 2x2 dims 0 (2)",
        "hybrid 2x2 dims 1 (2)",
        "hybrid 2x2 dims 2 (2)",
    ]
    assert len(four) == 1 + 3 + 3 + 3  # P=4: three dims and three square pairs
    eight = [c for c in candidates(8, layers) if c.spatial == 8]
    assert len(eight) == 3 + 6  # a (4, 2) grid both ways round
    assert {c.kind for c in candidates(8, layers)} == {"sample", "hybrid", "spatial"}
    assert all(c.groups <= 2 for c in candidates(8, layers, global_batch=2))
    assert spatial(4, dims=(1, 2), grid=(2, 2)).tensor_dims == (3, 4)


def test_ranking_picks_sample_parallelism_when_memory_allows_and_the_link_is_slow():
    m = model(link=SLOW)
    ranked = m.choose(m.candidates(4), global_batch=8, budget_bytes=1 << 34)
    assert ranked[0].candidate.kind == "sample"
    assert all(p.fits for p in ranked)
    assert [p.step_s for p in ranked] == sorted(p.step_s for p in ranked)
    assert "sample 4x1" in format_table(ranked)


def test_ranking_goes_spatial_when_the_budget_forces_it():
    """One sample over the budget under sample parallelism: spatial, even on a slow link."""
    m = model(link=SLOW)
    one_sample = m.memory_bytes(SAMPLE, local_batch=1)["total"]
    ranked = m.choose(m.candidates(4), global_batch=4, budget_bytes=one_sample - 1)
    assert ranked[0].fits and ranked[0].candidate.spatial > 1
    assert not ranked[-1].fits and ranked[-1].candidate.kind == "sample"
    assert ranked[0].memory_bytes < one_sample


def test_a_local_batch_over_the_budget_trains_in_micro_batches():
    m = model()
    whole = m.predict(SAMPLE, global_batch=4)
    (fitted,) = m.choose([SAMPLE], global_batch=4, budget_bytes=whole.memory_bytes - 1)
    assert fitted.fits and fitted.micro_batches == 2 and fitted.memory_bytes < whole.memory_bytes


def test_no_layout_fits_the_error_names_the_smallest_p():
    m = model(layers=conv_stack(side=64, channels=4))
    need = {p: m.memory_bytes(spatial(p), local_batch=1)["total"] for p in (2, 3, 4)}
    budget = (need[3] + need[4]) // 2  # P = 4 fits one sample, P = 3 does not
    assert need[2] > budget
    with pytest.raises(ConfigError, match=r"one sample fits from spatial=4 \(spatial 1x4"):
        m.choose(m.candidates(2), global_batch=2, budget_bytes=budget)
    with pytest.raises(ConfigError, match="no spatial split of up to 4096 ranks fits"):
        m.choose(m.candidates(2), global_batch=2, budget_bytes=m.parameter_bytes)


# -- validation and purity ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: LayoutCandidate(groups=0), "groups=0"),
        (lambda: LayoutCandidate(groups=1, spatial=4, dims=(0,), grid=(2,)), "product"),
        (lambda: LayerShape(name="x", kind="deconv", in_shape=(1, 4), out_shape=(1, 4)), "kind"),
        (lambda: LayerShape(name="c", kind="conv", in_shape=(1, 4), out_shape=(1, 4)), "Window"),
        (lambda: LayerFit(fixed_s=-1.0, per_voxel_s=0.0), "fixed_s"),
        (lambda: model(layers=conv_stack()).replace(fits={}), "no LayerFit"),
        (lambda: candidates(0, conv_stack()), "workers"),
    ],
)
def test_bad_input_names_the_field(build, words):
    with pytest.raises(ConfigError, match=words):
        build()


def test_the_layout_model_imports_neither_torch_nor_dask():
    code = (
        "import sys, dataflow.costmodel.layout_cost as L; "
        "print(sorted(m for m in ('torch', 'distributed', 'dask', 'numba') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
