"""layout="auto" predicts the same for the same inputs (issue 25): the layer timings are
measured once per model and sample shape in a process and reused, and every prediction
names the measurement it rests on. Pure: the measurements are given (a stand-in for
``calibrate_layout`` that would time differently on every call), nothing is timed."""

from __future__ import annotations

import itertools

import pytest
from test_layout_choice import volume_pipeline

import dataflow.spatial.profile as profile
from dataflow.costmodel.collective import Link, Topology
from dataflow.costmodel.layout_cost import (
    GIVEN,
    LayerFit,
    LayoutCandidate,
    LayoutModel,
    format_table,
)
from dataflow.planning.layout_choice import (
    MEMORY_ONLY,
    forget_layout_measurements,
    layout_model,
    resolve,
)
from dataflow.spatial.profile import JITTER_CAP, plausible_jitter, plausible_scale


@pytest.fixture
def live_timings(monkeypatch):
    """``calibrate_layout`` as a live timing on a busy machine: each call measures
    another speed (17 ms, then 6 s, ...). Returns the calls made."""
    calls = []
    speeds = itertools.cycle([1e-3, 0.4, 2e-3])

    def measure(module, shape, *, link, optimizer_states=1, **_):
        seconds = next(speeds)
        layers = tuple(profile.layer_shapes(module, shape))
        fits = {x.name: LayerFit(fixed_s=seconds, per_voxel_s=0.0) for x in layers}
        calls.append(seconds)
        return LayoutModel(
            layers=layers,
            fits=fits,
            topology=link if isinstance(link, Topology) else Topology(intra=link),
            optimizer_states=optimizer_states,
            jitter=0.1,
            basis=f"measurement {len(calls)}: {seconds} s a layer",
        )

    forget_layout_measurements()
    monkeypatch.setattr(profile, "calibrate_layout", measure)
    yield calls
    forget_layout_measurements()


def test_the_same_choice_twice_predicts_the_same_and_names_its_basis(live_timings):
    pipe = volume_pipeline(layout="auto")
    first_layout, first = resolve(pipe.trainer, workers=2, epochs=1)
    again_layout, again = resolve(volume_pipeline(layout="auto").trainer, workers=2, epochs=1)
    assert [p.to_dict() for p in again] == [p.to_dict() for p in first]
    assert again_layout == first_layout
    assert len(live_timings) == 1  # measured once, then reused
    assert {p.basis for p in first} == {"measurement 1: 0.001 s a layer"}
    assert first[0].to_dict()["basis"] == "measurement 1: 0.001 s a layer"
    assert "predicted from: measurement 1: 0.001 s a layer" in format_table(first)
    forget_layout_measurements()  # a new measurement, and the predictions say so
    _, measured_again = resolve(pipe.trainer, workers=2, epochs=1)
    assert len(live_timings) == 2
    assert {p.basis for p in measured_again} == {"measurement 2: 0.4 s a layer"}


def test_a_layout_model_predicts_purely_from_its_fits():
    layers = layout_model(volume_pipeline().trainer, calibrate=False)
    assert layers.basis == MEMORY_ONLY
    fits = {name: LayerFit(fixed_s=1e-3, per_voxel_s=1e-9) for name in layers.fits}
    model = layers.replace(fits=fits, basis="calibrate_layout abc: given in this test")
    candidate = LayoutCandidate(groups=1, spatial=2, dims=(0,), grid=(2,))
    one = model.predict(candidate, global_batch=4)
    assert model.predict(candidate, global_batch=4) == one
    assert one.basis == "calibrate_layout abc: given in this test"
    unnamed = LayoutModel(
        layers=model.layers, fits=fits, topology=Topology(intra=Link(latency_s=1e-5, bandwidth=1e9))
    )
    assert unnamed.predict(candidate, global_batch=4).basis == GIVEN


def test_implausible_calibration_figures_are_discarded_and_said():
    assert plausible_scale(1.2) == (1.2, "measured")
    scale, why = plausible_scale(0.01)  # the whole model 100x faster than its layers
    assert scale == 1.0 and "implausible, discarded" in why
    assert plausible_jitter(0.1) == (0.1, "measured")
    jitter, why = plausible_jitter(40.0)
    assert jitter == JITTER_CAP and "capped" in why
