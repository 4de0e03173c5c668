"""The partitioned module equals the unpartitioned one (issue 16, item 3).

Real processes in a real gloo group (``dataflow.spatial.local_group``), random layer stacks drawn by
hypothesis (derandomized: the same cases every run): the output on every rank and the
parameter gradients summed over the group equal the whole model's to 1e-5.
"""

from __future__ import annotations

import pytest
import spatial_cases
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow.spatial.geometry import Window

TOL = 1e-5  # float32, relative to the largest value of each kind
TOL_NORM = 1e-4  # float32 through BatchNorm: its reduction order differs (see module docs)
TOL64 = 1e-9  # float64: what is left is rounding, so any logic error stands out


@st.composite
def cases(draw, nd_choices=(1, 2, 3), dims_count=1, parts=2):
    nd = draw(st.sampled_from(nd_choices))
    size = {1: (9, 40), 2: (8, 24), 3: (6, 13)}[nd]
    spatial = [draw(st.integers(*size)) for _ in range(nd)]
    channels = draw(st.sampled_from([1, 2, 4]))
    extents, layers, c = list(spatial), [], channels
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["conv", "conv", "max", "avg"]))
        k = draw(st.integers(1, 5))
        s = draw(st.integers(1, 3))
        d = draw(st.integers(1, 2)) if kind != "avg" else 1
        p = draw(st.integers(0, k // 2)) if kind != "conv" else draw(st.integers(0, k))
        if kind == "conv":
            groups = draw(st.sampled_from([1, 2])) if c % 2 == 0 else 1
            out = draw(st.sampled_from([2, 4]))
            if draw(st.booleans()) and s == 1:
                kw = dict(out=out, kernel_size=k, dilation=d, padding="same", groups=groups)
                window = Window(k, 1, d, d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2)
            else:
                kw = dict(out=out, kernel_size=k, stride=s, padding=p, dilation=d, groups=groups)
                window = Window(k, s, d, p, p)
            c = out
        else:
            ceil = draw(st.booleans())
            kw = dict(kernel_size=k, stride=s, padding=p, ceil_mode=ceil)
            if kind == "max":
                kw["dilation"] = d
            else:
                kw["count_include_pad"] = draw(st.booleans())
            window = Window(k, s, d, p, p, ceil)
        extents = [window.out_extent(n) for n in extents]
        if min(extents) < 1:
            break
        layers.append((kind, kw))
        if draw(st.booleans()):
            layers.append(("bn", {}))
        if draw(st.booleans()):
            layers.append(("relu", {}))
    if min(extents) < 1 or not layers:
        layers = [("conv", dict(out=2, kernel_size=1))]
    head = draw(st.sampled_from(["none", "linear", "gap"]))
    if head == "linear":
        layers += [("flatten", {}), ("linear", dict(out=3))]
    elif head == "gap":
        layers += [("gap", {}), ("flatten", {})]
    dims = tuple(range(2, 2 + dims_count))
    weights = None
    if draw(st.booleans()):
        weights = [
            tuple(draw(st.sampled_from([1.0, 2.0, 3.0])) for _ in range(parts)) for _ in dims
        ]
    return dict(
        seed=draw(st.integers(0, 1000)),
        nd=nd,
        channels=channels,
        shape=(draw(st.integers(2, 3)), channels, *spatial),
        dims=dims,
        layers=layers,
        weights=weights,
        train=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "float64"])),
    )


def _check(results, case):
    if case["dtype"] == "float64":
        tol = TOL64
    else:
        tol = TOL_NORM if any(kind == "bn" for kind, _ in case["layers"]) else TOL
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if v > tol}
        assert not bad, f"rank {rank}: {bad}"


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_random_stacks_on_two_ranks(pool2, case):
    _check(pool2.run(spatial_cases.compare, case), case)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases(nd_choices=(2, 3), dims_count=2))
def test_random_stacks_on_a_two_by_two_grid(pool4, case):
    _check(pool4.run(spatial_cases.compare, case, grid=(2, 2)), case)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases(nd_choices=(1, 2), parts=4))
def test_random_stacks_on_four_ranks_along_one_dimension(pool4, case):
    """Regions of a few rows: halos reach past the next rank, some ranks own nothing."""
    _check(pool4.run(spatial_cases.compare, case, grid=(4,)), case)


def test_a_residual_block_with_a_strided_shortcut(pool2):
    for errors in pool2.run(spatial_cases.residual, (3, 2, 20, 11)):
        assert errors["output"] < TOL and errors["grad"] < TOL, errors


def test_dropout_masks_agree_across_the_group(pool2):
    first, second = pool2.run(spatial_cases.dropout_outputs)
    assert first == second
    assert any(v == 0.0 for v in first) or len(first) < 4


def test_bf16_autocast_activations_exchange_their_halos_as_the_whole_model_computes(pool2):
    """``precision="bf16"`` on the CPU: the activations are bf16, so are the halo slabs
    (packed by torch there: the Numba kernel takes float32 and float64 only). The
    partitioned stack equals the whole one to bf16's rounding (a wrong halo is off by
    the activations' own size)."""
    layers = [
        ("conv", dict(out=4, kernel_size=3, padding=1)),
        ("relu", {}),
        ("conv", dict(out=2, kernel_size=3, padding=1)),
    ]
    case = dict(seed=3, nd=2, channels=2, shape=(2, 2, 12, 10), dims=(2,), layers=layers)
    for errors in pool2.run(spatial_cases.compare, {**case, "autocast": "bf16"}):
        assert errors["output"] < 2e-2 and errors["grad"] < 2e-2, errors


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("upsample", "'1' (Upsample) cannot run on a region"),
        ("reflect", "padding_mode='reflect'"),
        ("groupnorm", "(GroupNorm) cannot run on a region"),
    ],
)
def test_a_layer_it_cannot_partition_is_named(pool2, name, says):
    for message in pool2.run(spatial_cases.refused, name):
        assert message.startswith("ModelError") and says in message, message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases(nd_choices=(2, 3)))
def test_random_stacks_on_two_ranks_on_cuda(pool2, case):
    """The CUDA path: halo pack kernels on the GPU, slabs through the group's backend."""
    case = {**case, "device": "cuda"}
    _check(pool2.run(spatial_cases.compare, case), case)
