"""Memory per worker under spatial decomposition (issue 16, item 5), counted exactly.

A CosmoFlow-like 3D stack runs one forward on one volume: whole in this process
(sample parallelism, P = 1), split along one dim over a real gloo group of 2
processes and along two over 4 (``SpatialModule``, P = 2 and P = 2 x 2). What
autograd keeps for backward is counted with ``saved_tensors_hooks`` (each storage
once, parameters apart), so the figures are exact byte counts, not timings; the
layout model's prediction must come within 15 %.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dataflow.costmodel.collective import Link, Topology
from dataflow.costmodel.layout_cost import LayerFit, LayoutCandidate, LayoutModel
from dataflow.spatial.geometry import split_extent
from dataflow.spatial.module import SpatialModule
from dataflow.spatial.profile import layer_shapes, saved_activation_bytes

pytestmark = pytest.mark.slow  # process groups of 2 and 4 ranks (LocalGroup)

SAMPLE = (4, 32, 32, 32)  # CosmoFlow's 4 redshifts, a 32^3 crop
BATCH = 1
TOLERANCE = 0.15


def cosmo_net(blocks: int = 5, width: int = 8, sample: tuple[int, ...] = SAMPLE) -> nn.Module:
    """5 x (conv3d 3^3 + BatchNorm + ReLU + maxpool 2), flatten, two linear layers."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c, side = sample[0], sample[1]
    for i in range(blocks):
        w = width * 2 ** min(i, 3)
        layers += [nn.Conv3d(c, w, 3, padding=1), nn.BatchNorm3d(w), nn.ReLU(), nn.MaxPool3d(2)]
        c, side = w, side // 2
    layers += [nn.Flatten(), nn.Linear(c * side**3, 16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def volume() -> torch.Tensor:
    return torch.randn((BATCH, *SAMPLE), generator=torch.Generator().manual_seed(1))


def rank_saved_bytes(group, dims: tuple[int, ...]) -> int:  # type: ignore[no-untyped-def]
    """On each rank of the pool: the partitioned net's forward on its region."""
    model = SpatialModule(cosmo_net(), group, dims)
    x = volume()
    for i, d in enumerate(dims):
        lo, hi = split_extent(x.shape[d], group.grid[i])[group.coords[i]]
        x = x.narrow(d, lo, hi - lo)
    return saved_activation_bytes(model, x.clone())  # its own storage, as a region read


def memory_model() -> LayoutModel:
    layers = layer_shapes(cosmo_net(), SAMPLE)
    fits = {layer.name: LayerFit(fixed_s=0.0, per_voxel_s=0.0) for layer in layers}
    link = Link(latency_s=1e-5, bandwidth=1e9)
    return LayoutModel(layers=tuple(layers), fits=fits, topology=Topology(intra=link))


@pytest.fixture(scope="module")
def measured(pool2, pool4) -> dict[str, list[int]]:
    whole = saved_activation_bytes(cosmo_net(), volume())
    split = pool2.run(rank_saved_bytes, (2,), grid=(2,))
    grid = pool4.run(rank_saved_bytes, (2, 3), grid=(2, 2))
    return {"P1": [whole], "P2": split, "P4": grid}


def test_the_model_predicts_the_bytes_each_rank_keeps(measured):
    model = memory_model()
    for key, candidate in (
        ("P1", LayoutCandidate(groups=1)),
        ("P2", LayoutCandidate(groups=1, spatial=2, dims=(0,), grid=(2,))),
        ("P4", LayoutCandidate(groups=1, spatial=4, dims=(0, 1), grid=(2, 2))),
    ):
        predicted = model.memory_bytes(candidate, local_batch=BATCH)["activations"]
        worst = max(measured[key])
        assert abs(predicted - worst) <= TOLERANCE * worst, (key, predicted, measured[key])


def test_the_ranks_of_an_even_split_keep_alike(measured):
    for key in ("P2", "P4"):
        assert max(measured[key]) - min(measured[key]) <= 0.02 * max(measured[key])


def test_memory_per_worker_falls_as_one_over_p(measured):
    """Each rank keeps its region of every layer, plus the halo slabs its shells read
    and the gathered tensors: about half of the whole at P = 2."""
    whole = measured["P1"][0]
    assert 0.4 * whole <= max(measured["P2"]) <= 0.6 * whole
    assert 0.2 * whole <= max(measured["P4"]) <= 0.35 * whole
