"""memory_per_worker and layout="auto" (issue 16, items 5 and 6): a fit whose samples do
not fit one worker is refused naming the smallest spatial split, or laid out spatially
by the layout model. Memory is predicted from shapes, so these tests pin bytes, never
times."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dataflow as dfl
from dataflow.costmodel.layout_candidates import LayoutCandidate
from dataflow.planning.layout_choice import layout_model, parse_bytes, resolve


class Volume(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv3d(1, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool3d(2),
            torch.nn.Conv3d(8, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool3d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def volume_pipeline(**options) -> dfl.Pipeline:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 1, 16, 16, 16)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)
    defaults = dict(
        model=Volume,
        device="cpu",
        loss=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(2),
        progress=False,
    )
    return dfl.Pipeline(**{**defaults, **options})


def between_one_and_two() -> int:
    """A budget one sample fits under spatial=2 but not on one worker."""
    model = layout_model(volume_pipeline().trainer, calibrate=False)
    one = model.memory_bytes(LayoutCandidate(groups=1), local_batch=1)["total"]
    two = model.memory_bytes(
        LayoutCandidate(groups=1, spatial=2, dims=(0,), grid=(2,)), local_batch=1
    )["total"]
    assert two < 0.75 * one  # the activations, most of the memory, are split
    return (one + two) // 2


def test_sizes_parse_with_units():
    assert parse_bytes("512MB") == 512 * 10**6 and parse_bytes("2 GiB") == 2 * 2**30
    assert parse_bytes(1000) == 1000 and parse_bytes(None) is None
    with pytest.raises(dfl.ConfigError, match="memory_per_worker='lots'"):
        parse_bytes("lots")
    with pytest.raises(dfl.ConfigError, match="memory_per_worker"):
        volume_pipeline(memory_per_worker="12 parsecs")


def test_a_sample_over_the_budget_is_refused_naming_the_smallest_spatial_split():
    budget = between_one_and_two()
    pipe = volume_pipeline(memory_per_worker=budget)
    with pytest.raises(dfl.ConfigError, match="one sample fits from spatial=2"):
        resolve(pipe.trainer, workers=2, epochs=1)


def test_auto_lays_the_samples_out_spatially_when_they_do_not_fit():
    budget = between_one_and_two()
    pipe = volume_pipeline(memory_per_worker=budget, layout="auto")
    layout, weighed = resolve(pipe.trainer, workers=2, epochs=1)
    assert layout is not None and layout.spatial == 2
    assert weighed[0].fits and not [p for p in weighed if p.candidate.spatial == 1 and p.fits]


def test_auto_keeps_sample_parallelism_when_memory_allows():
    pipe = volume_pipeline(layout="auto")
    layout, weighed = resolve(pipe.trainer, workers=2, epochs=1)
    assert {p.candidate.kind for p in weighed} >= {"sample", "spatial"}
    assert weighed[0].step_s <= min(p.step_s for p in weighed)
    assert layout is None or layout.spatial == weighed[0].candidate.spatial


@pytest.mark.slow
def test_a_fit_with_auto_trains_spatially_under_the_budget(client):
    budget = between_one_and_two()
    result = volume_pipeline(memory_per_worker=budget, layout="auto").fit(epochs=1, client=client)
    assert result.history.info["layout"].startswith("spatial=2")
    assert result.history.info["layout_candidates"][0]["fits"]
    assert len(result.history.steps) == 8


def test_a_random_flip_along_a_split_dimension_is_refused(client):
    pipe = volume_pipeline(
        transforms=[dfl.ops.RandomFlip(axes=(2, 3))], layout=dfl.Layout(spatial=2)
    )
    with pytest.raises(dfl.ConfigError, match=r"RandomFlip\(axes=\(2, 3\)\) moves data along"):
        pipe.fit(epochs=1, client=client)
