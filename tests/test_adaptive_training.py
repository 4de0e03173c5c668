"""The Adaptive schedule on a real LocalCluster: the engine measures the gradient noise
scale from the allreduce (or from micro-batches on one replica) and the schedule grows
the batch and the LR from it."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from conftest import (
    TinyCNN,
    WitnessPairs,
    learnable_labels,
    make_data,
    max_abs_diff,
    noise_pairs_fed,
    tiny_pipeline,
)

import dataflow as dfl
from dataflow.history.report_plots import report_title
from dataflow.schedule.noise_scale import adascale_gain

pytestmark = pytest.mark.slow


def learnable_data(n: int = 192) -> tuple[np.ndarray, np.ndarray]:
    """make_data's inputs with labels that follow a signal in them (so |G|^2 is real)."""
    x, _ = make_data(n)
    return x, learnable_labels(x)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02)


@pytest.mark.parametrize("replicas", [2, 1])
def test_adaptive_grows_the_batch_from_the_measured_noise_scale(client, replicas):
    x, y = learnable_data()
    schedule = dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0)
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule, replicas=replicas)
    result = pipe.fit(epochs=4, client=client)
    phases = result.history.phases
    assert len(phases) == 4
    if replicas == 1:  # one replica measures from two micro-batches per step
        assert all(p["micro_batches"] == [2] for p in phases)
    for before, after in itertools.pairwise(phases):
        measured = before["measured_noise_scale"]
        # None while the estimate of |G|^2 is not positive yet (noise dominates)
        assert measured is None or (math.isfinite(measured) and measured > 0)
        # each phase is chosen from the estimate measured up to the phase before
        assert after["noise_scale"] == (None if measured is None else pytest.approx(measured))
        assert after["global_batch"] == schedule.next_batch(before["global_batch"], measured)
        assert after["gain"] == pytest.approx(
            schedule.lr_scale(after["global_batch"], measured, before["gain"] or 1.0)
        )
        assert after["lr"] == pytest.approx(0.02 * after["gain"])
    assert phases[-1]["measured_noise_scale"] is not None
    assert phases[-1]["global_batch"] > phases[0]["global_batch"]
    for epoch in range(4):
        assert result.ledger.consumed(epoch).tolist() == list(range(192))


def test_adaptive_under_local_updates_measures_as_synchronous_training(client):
    """Local and asynchronous updates measure the noise scale once per window, from the
    replicas' first gradients (all on the window's starting weights), allreduced once.
    With one step per window that is every step, on the same weights as synchronous
    training: the same estimates, the same batches, the same model."""
    x, y = learnable_data()
    schedule = dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0)
    options = dict(optimizer=plain_sgd, schedule=schedule, replicas=2)
    local = tiny_pipeline(x, y, sync=dfl.sync.Local(period_steps=1), **options)
    synchronous = tiny_pipeline(x, y, window_steps=1, **options)
    got = local.fit(epochs=4, client=client)
    expected = synchronous.fit(epochs=4, client=client)
    mine, theirs = got.history.phases, expected.history.phases
    assert [p["global_batch"] for p in mine] == [p["global_batch"] for p in theirs]
    assert mine[-1]["global_batch"] > mine[0]["global_batch"]
    for a, b in zip(mine, theirs, strict=True):
        if b["measured_noise_scale"] is None:
            assert a["measured_noise_scale"] is None
        else:
            assert a["measured_noise_scale"] == pytest.approx(b["measured_noise_scale"], rel=1e-4)
    assert max_abs_diff(got.model, expected.model) <= 1e-5


def test_adaptive_grows_the_batch_under_asynchronous_updates(client):
    x, y = learnable_data()
    # one measurement per window: short windows, and trust an estimate from 3 of them
    schedule = dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0, min_measured_steps=3)
    sync = dfl.sync.Async(staleness=1)
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule, sync=sync, window_steps=3)
    result = pipe.fit(epochs=4, client=client)
    phases = result.history.phases
    measured = [p["measured_noise_scale"] for p in phases]
    # (4 windows a phase are few: a phase's estimate of |G|^2 may not be positive yet)
    assert measured[0] is not None and all(m is None or m > 0 for m in measured)
    assert phases[-1]["global_batch"] > phases[0]["global_batch"]
    for epoch in range(4):
        assert result.ledger.consumed(epoch).tolist() == list(range(192))


@pytest.mark.parametrize("sync", ["synchronous", "local"])
def test_stepwise_adascale_sets_each_phase_lr_from_the_noise_measured_before_it(client, sync):
    """The user's batches, the LR from the engine's measured noise scale (AdaScale's
    gain): each phase's gain is the one of the estimate measured up to the phase
    before. Under local updates the noise is measured once per window, as for
    Adaptive."""
    x, y = learnable_data()
    schedule = dfl.schedule.Stepwise({0: 8, 1: 16, 2: 32, 3: 64}, lr_scaling="adascale")
    options = dict(sync=dfl.sync.Local(period_steps=1)) if sync == "local" else {}
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule, replicas=2, **options)
    result = pipe.fit(epochs=4, client=client)
    phases = result.history.phases
    assert [p["global_batch"] for p in phases] == [8, 16, 32, 64]
    assert phases[0]["gain"] == 1.0 and phases[0]["lr"] == pytest.approx(0.02)
    gains = []
    for before, after in itertools.pairwise(phases):
        measured = before["measured_noise_scale"]
        assert measured is None or (math.isfinite(measured) and measured > 0)
        assert after["noise_scale"] == (None if measured is None else pytest.approx(measured))
        if measured is None:  # the previous gain; or |G|^2 not resolved: the linear rule's
            expected = [before["gain"], after["global_batch"] / 8]
        else:
            expected = [adascale_gain(measured, 8, after["global_batch"])]
        assert any(after["gain"] == pytest.approx(e) for e in expected)
        assert after["lr"] == pytest.approx(0.02 * after["gain"])
        gains.append(after["gain"])
    assert any(g > 1.0 for g in gains)  # some estimate was trusted and raised the LR
    for epoch in range(4):
        assert result.ledger.consumed(epoch).tolist() == list(range(192))


def test_stepwise_counting_progress_runs_each_phase_as_long_as_its_gain_needs(client):
    """Stepwise(scale_invariant=True): the fit's 3 epochs are of progress at the first
    batch. A phase at batch B with gain r makes r*B0/B of it per epoch of data, so it
    runs the whole epochs of data that reach the table's next entry; the ledger holds
    every epoch of data trained, each sample once. (Under local updates the gain comes
    from the same measurement as for the LR, tested above; the count is the schedule's.)"""
    x, y = learnable_data()
    schedule = dfl.schedule.Stepwise({0: 8, 1: 16, 2: 32}, scale_invariant=True)
    pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule, replicas=2)
    result = pipe.fit(epochs=3, client=client)
    phases = result.history.phases
    assert [p["global_batch"] for p in phases] == [8, 16, 32]
    progress = 0.0
    for phase, target in zip(phases, (1, 2, 3), strict=True):
        assert phase["progress_start"] == pytest.approx(progress)
        per_epoch = phase["gain"] * 8 / phase["global_batch"]  # gain: AdaScale's r
        epochs = phase["end_epoch"] - phase["start_epoch"]
        assert epochs == math.ceil((target - progress) / per_epoch - 1e-9)
        progress = phase["progress_end"]
        assert progress == pytest.approx(phase["progress_start"] + epochs * per_epoch)
    assert progress >= 3
    trained = phases[-1]["end_epoch"]
    assert [e["epoch"] for e in result.history.epochs] == list(range(trained))
    said = f"{trained} epoch(s) of data ({progress:.2f} epochs of progress, 3 asked)"
    assert result.summary().startswith(f"trained {said}")
    assert f"  ·  {said}  ·  " in report_title(result.history)  # dataflow report's title
    for epoch in range(trained):
        assert result.ledger.consumed(epoch).tolist() == list(range(192))


@pytest.mark.parametrize(
    ("precision", "measure_every"), [("fp32", "auto"), ("fp32", 3), ("fp16", "auto")]
)
def test_pairs_read_once_per_window_equal_per_step_reads_on_the_measured_steps(
    client, tmp_path, monkeypatch, precision, measure_every
):
    """The pairs the driver's tracker is fed (norms left on the device, read once per
    window) equal, step for step, the per-step reads of the previous method. With
    measure_every=3 only every third step of the fit has pairs (one per replica); "auto"
    measures every step of these short phases. In fp16 the loss scale is divided out of
    the local norm as from the reduced one."""
    monkeypatch.setenv("DATAFLOW_ALLOW_CPU_FP16", "1")  # fp16 on the CPU: tests only
    fed = noise_pairs_fed(monkeypatch)
    x, y = learnable_data()
    graph = dfl.Graph()
    out = graph.add(
        dfl.stages.Forward(TinyCNN, torch.nn.functional.cross_entropy),
        graph.add(dfl.stages.Load(dfl.io.ArraySource(x, y))),
    )
    reduced = graph.add(WitnessPairs(str(tmp_path)), graph.add(dfl.stages.Backward(), out))
    graph.add(dfl.stages.Update(plain_sgd), reduced)
    schedule = dfl.schedule.Adaptive(8, max_batch=32, measure_every=measure_every)
    options = dict(device="cpu", replicas=2, precision=precision, dry_run=False)
    trainer = dfl.Trainer(graph, schedule=schedule, progress=False, **options)
    history = trainer.fit(epochs=3, client=client).history

    witness: dict[int, list] = {}
    for file in sorted(tmp_path.glob("pairs.*.jsonl")):
        for line in file.read_text().splitlines():
            index, *pair, _ = json.loads(line)
            witness.setdefault(index, []).append(pair)
    steps = [s["step"] for s in history.steps]
    assert sorted(witness) == steps
    assert all(len(w) == 2 for w in witness.values()), witness
    every = 1 if measure_every == "auto" else measure_every
    skipped = {s["step"] for s in history.steps if s.get("skipped")}
    measured = [i for i in steps if i % every == 0 and i not in skipped]
    got: dict[int, list] = {}
    for index, *pair in fed:
        got.setdefault(index, []).append(pair)
    assert sorted(got) == measured and len(measured) >= len(steps) // every - 1
    for index in measured:
        assert len(got[index]) == 2  # one pair per replica
        for mine, theirs in zip(sorted(got[index]), sorted(witness[index]), strict=True):
            assert mine[0] == theirs[0] and mine[2] == theirs[2]  # batches
            assert mine[1] == pytest.approx(theirs[1], rel=1e-5)  # |g_r|^2
            assert mine[3] == pytest.approx(theirs[3], rel=1e-5)  # |G|^2


class Warm(TinyCNN):
    """Inputs x 30: the first fp16 steps overflow at the initial loss scale 2^16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 30.0)


def test_fp16_overflow_steps_are_left_out_of_the_noise_estimate(client, monkeypatch):
    """A step dropped for an fp16 overflow (or a non-finite skip) has no finite norms:
    its pairs are left out of the estimate, which the steps that trained still feed."""
    monkeypatch.setenv("DATAFLOW_ALLOW_CPU_FP16", "1")  # fp16 on the CPU: tests only
    x, y = learnable_data()
    schedule = dfl.schedule.Adaptive(8, max_batch=32, min_measured_steps=0)
    options = dict(model=Warm, optimizer=plain_sgd, replicas=2, precision="fp16")
    pipe = tiny_pipeline(x, y, schedule=schedule, **options)
    phases = pipe.fit(epochs=2, client=client).history.phases
    assert phases[0].overflow_steps > 0
    assert all(p["measured_noise_scale"] is None or p["measured_noise_scale"] >= 0 for p in phases)
