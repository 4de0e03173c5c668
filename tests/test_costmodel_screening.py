"""Calibration screens its timing samples (issue 25): a sample far off its batch's
others, or a batch far off the line through the others, is discarded and reported with
why; a larger batch never runs faster. Pure: the samples are given, nothing is timed."""

from __future__ import annotations

import json

import pytest

from dataflow.costmodel import ComputeFit, CostModel, Link, Topology
from dataflow.costmodel.calibration import _screen
from dataflow.costmodel.screening import discarded_note, screen


def step(batch: int) -> float:
    """A step of 5 ms plus 1 ms per sample (the 'true' times of these tests)."""
    return 0.005 + 0.001 * batch


def test_a_sample_twenty_times_too_fast_is_discarded_and_reported():
    samples = {8: [step(8)] * 4 + [step(8) / 20], 16: [step(16)] * 5, 32: [step(32)] * 5}
    screened = screen(samples)
    assert screened.points == ((8, step(8)), (16, step(16)), (32, step(32)))
    assert (screened.kept, screened.total) == (14, 15)
    [dropped] = screened.discarded
    assert dropped["term"] == "compute" and dropped["batch"] == 8
    assert dropped["action"] == "discarded" and dropped["seconds"] == pytest.approx(step(8) / 20)
    assert "20.0x faster than the median of its batch" in dropped["reason"]
    assert "14 of 15 timing sample(s) used, 1 discarded" in screened.note()


def test_two_disagreeing_samples_are_judged_by_the_other_batches():
    # the recorded case: 0.95 ms against a ~21 ms step, one of two repeats
    samples = {8: [step(8), step(8) / 20], 16: [step(16)] * 2, 32: [step(32)] * 2}
    screened = screen(samples)
    assert dict(screened.points)[8] == pytest.approx(step(8))  # not the mean of the two
    assert [d["batch"] for d in screened.discarded] == [8]
    assert "the other batches' line expects 13 ms" in screened.discarded[0]["reason"]
    alone = screen({8: [step(8), step(8) / 20]})  # nothing to judge by: kept, as suspect
    assert [d["action"] for d in alone.discarded] == ["suspect", "suspect"]


def test_a_batch_far_off_the_line_through_the_others_is_discarded():
    samples = {8: [step(8)] * 3, 16: [step(16) / 20] * 3, 32: [step(32)] * 3}
    screened = screen(samples)
    assert screened.points == ((8, step(8)), (32, step(32)))
    assert len(screened.discarded) == 3 and {d["batch"] for d in screened.discarded} == {16}
    assert "20.0x below the line through the other batches" in screened.discarded[0]["reason"]


def test_an_end_batch_of_three_is_not_judged_by_the_line_through_the_other_two():
    """The recorded case (3 workers, a loaded 2-core machine): 15.7 ms at batch 21, 14.1
    at 37, 35.9 at 64. The line through the last two gives 1.2 ms at 21, so batch 21 was
    discarded, and the fit on the two left had a negative intercept (-14 ms). Three
    batches judge only their middle one; 37's median is raised to 21's instead."""
    samples = {21: [0.0157] * 5, 37: [0.0141] * 5, 64: [0.0359] * 5}
    screened = screen(samples)
    assert screened.points == ((21, 0.0157), (37, 0.0157), (64, 0.0359))
    assert [(d["batch"], d["action"]) for d in screened.discarded] == [(37, "raised")]
    four = {8: [step(8)] * 3, 16: [step(16)] * 3, 24: [step(24)] * 3, 32: [step(32) * 20] * 3}
    assert [p[0] for p in screen(four).points] == [8, 16, 24]  # four: an end is judged


def test_a_larger_batch_never_runs_faster_and_says_so():
    screened = screen({8: [step(8)] * 3, 16: [step(8) * 0.9] * 3})
    assert screened.points == ((8, step(8)), (16, step(8)))
    [raised] = screened.discarded
    assert raised["action"] == "raised" and raised["batch"] == 16
    assert screened.kept == screened.total == 6


def test_plausible_samples_are_all_kept():
    noisy = {8: [0.012, 0.013, 0.014], 16: [0.02, 0.022, 0.021], 32: [0.036, 0.04, 0.037]}
    screened = screen(noisy)
    assert screened.discarded == () and screened.kept == screened.total == 9
    assert screened.points == ((8, 0.013), (16, 0.021), (32, 0.037))


def test_the_calibration_records_what_it_discarded():
    """calibrate's own screening of the probe's windows, and the model it fills."""
    windows = {b: {"windows": [{"compute_s": step(b)} for _ in range(4)]} for b in (8, 16, 32)}
    windows[16]["windows"].append({"compute_s": step(16) / 20})
    screened = _screen(windows, (8, 16, 32), "compute")
    assert screened.points == ((8, step(8)), (16, step(16)), (32, step(32)))
    model = CostModel(
        compute=ComputeFit(points=screened.points),
        gradient_bytes=4,
        topology=Topology(intra=Link(latency_s=1e-5, bandwidth=1e9)),
        discarded=screened.discarded,
        notes={"discarded": discarded_note(screened.discarded)},
    )
    assert model.notes["discarded"].startswith("1 timing sample(s) discarded, 0 adjusted")
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))).discarded[0]["batch"] == 16
    assert discarded_note(()) == "no timing sample was implausible: none discarded"
