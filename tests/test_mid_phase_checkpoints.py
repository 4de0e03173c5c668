"""Checkpoints inside a phase (``fit(checkpoint_every=N)``): resuming from one ends
bit-identical to the uninterrupted run, and writing them does not change training.

A real LocalCluster with two worker processes; a model with BatchNorm (statistics that
differ between replicas until the phase ends) and dropout (each worker's random state).
"""

import numpy as np
import pytest
import torch
from conftest import learnable_labels, make_data, tiny_pipeline

import dataflow as dfl
from dataflow.checkpoint import CheckpointStore
from dataflow.errors import ConfigError
from dataflow.planning.plan import Plan, checkpoint_windows
from dataflow.schedule import PhaseSpec
from dataflow.stages.base import StepSpec

EPOCHS = 3


class NormDropCNN(torch.nn.Module):
    """Conv, BatchNorm and dropout: every kind of state a mid-phase resume must restore."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.norm = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.norm(self.conv(x))))
        return self.head(x.flatten(1))


def _pipeline(x, y, **options) -> dfl.Pipeline:
    return dfl.Pipeline(
        model=NormDropCNN,
        device="cpu",
        loss=torch.nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        source=dfl.io.ArraySource(x, y),
        # two phases, the second with a warmup ramp (stage state a resume must restore)
        schedule=dfl.schedule.Stepwise({0: 16, 2: 32}, lr_scaling="linear", warmup_steps=4),
        window_steps=2,  # pinned: checkpoint points in every phase, however fast the machine
        progress=False,
        **options,
    )


def _keep_up_to(store: CheckpointStore, path) -> None:
    """Delete every checkpoint newer than ``path``, as if the run had died after it."""
    for newer in [p for p in store.checkpoints() if p.name > path.name]:
        newer.unlink()
        CheckpointStore.manifest_path(newer).unlink()


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name


@pytest.mark.slow
def test_resume_from_mid_phase_checkpoints_is_bit_identical(client, tmp_path):
    x, y = make_data(320)
    plain = _pipeline(x, y).fit(EPOCHS, client=client)
    full = _pipeline(x, y).fit(
        EPOCHS, client=client, checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=1000
    )
    _assert_same_weights(plain.model, full.model)  # writing checkpoints changes nothing

    written = full.history.info["checkpoints"]
    mid = [c for c in written if c["mid_phase"]]
    assert {c["phase"] for c in mid} == {0, 1}, "checkpoints inside both phases"
    assert len(mid) >= 4
    store = CheckpointStore(tmp_path, keep=1000)
    # phase 1's first (after its first calibration step: inside the LR warmup), then one
    # in the middle of phase 0
    for point in (next(c for c in mid if c["phase"] == 1), mid[len(mid) // 4]):
        _keep_up_to(store, store.path(point["step"]))
        saved = store.load_latest()
        assert saved.mid_phase and saved.step == point["step"]
        assert len(saved.replica_buffers) == 2  # each replica's BatchNorm statistics

        resumed = _pipeline(x, y).fit(
            EPOCHS, client=client, checkpoint_dir=tmp_path, resume=True, keep_checkpoints=1000
        )
        assert resumed.history.info["resumed_from"]["step"] == point["step"]
        _assert_same_weights(full.model, resumed.model)
        steps = [s["step"] for s in resumed.history.steps]
        assert steps == list(range(len(full.history.steps)))
        assert [s["loss"] for s in resumed.history.steps] == [s["loss"] for s in full.history.steps]
        assert [p["phase"] for p in resumed.history.phases] == [0, 1]
        assert resumed.history.phases[-1]["lr"] == full.history.phases[-1]["lr"]
        for epoch in range(EPOCHS):
            assert resumed.ledger.consumed(epoch).tolist() == list(range(len(x)))


@pytest.mark.slow
def test_resume_mid_phase_on_fewer_replicas_keeps_every_sample_once(client, tmp_path):
    """Written on 2 replicas, resumed on 1: the rest of the epoch is re-split, and every
    sample is still trained on exactly once per epoch."""
    x, y = make_data(320)
    full = _pipeline(x, y).fit(
        EPOCHS, client=client, checkpoint_dir=tmp_path, checkpoint_every=4, keep_checkpoints=1000
    )
    store = CheckpointStore(tmp_path, keep=1000)
    point = next(c for c in full.history.info["checkpoints"] if c["mid_phase"])
    _keep_up_to(store, store.path(point["step"]))
    assert store.load_latest().mid_phase
    resumed = _pipeline(x, y, replicas=1).fit(
        EPOCHS, client=client, checkpoint_dir=tmp_path, resume=True
    )
    assert resumed.history.phases[0]["replicas"] == 1
    for epoch in range(EPOCHS):
        assert resumed.ledger.consumed(epoch).tolist() == list(range(len(x)))
    losses = [e["train_loss"] for e in resumed.history.epochs]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["adaptive", "stepwise-adascale", "stepwise-progress"])
def test_adaptive_resumed_mid_phase_measures_the_same_noise_and_batches(client, tmp_path, schedule):
    """The gradient-noise pairs of the steps before a mid-phase checkpoint are in it: the
    resumed fit measures the same noise scale, so it grows the batch (Adaptive) or sets
    the LR (Stepwise's AdaScale rule) the same way; counting progress, its phases run as
    many epochs. Resumed again from its end, the fit is done: its result, no training."""
    x, _ = make_data(192)
    y = learnable_labels(x)  # a learnable signal

    def pipe() -> dfl.Pipeline:
        return tiny_pipeline(
            x,
            y,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.02),
            schedule=dfl.schedule.Adaptive(8, max_batch=64)
            if schedule == "adaptive"
            else dfl.schedule.Stepwise(
                {0: 8, 1: 16, 2: 32, 3: 64},
                lr_scaling="adascale",
                scale_invariant=schedule == "stepwise-progress",
            ),
            window_steps=2,  # pinned: every phase has mid-phase checkpoints, on any machine
        )

    folder = dict(checkpoint_dir=tmp_path, keep_checkpoints=1000)
    full = pipe().fit(4, client=client, checkpoint_every=2, **folder)
    mid = [c for c in full.history.info["checkpoints"] if c["mid_phase"] and c["phase"] == 1]
    store = CheckpointStore(tmp_path, keep=1000)
    _keep_up_to(store, store.path(mid[len(mid) // 2]["step"]))
    resumed = pipe().fit(4, client=client, resume=True, **folder)

    def measured(result) -> list:
        keys = ("global_batch", "measured_noise_scale", "lr", "end_epoch", "progress_end")
        return [tuple(p.get(k) for k in keys) for p in result.history.phases]

    assert measured(resumed) == measured(full)
    assert full.history.phases[-1]["global_batch"] > 8
    _assert_same_weights(full.model, resumed.model)
    if schedule == "stepwise-progress":  # (Adaptive counts with the same code: pure tests)
        assert full.history.phases[-1]["progress_end"] >= 4
        below = any(p["gain"] < p["global_batch"] / 8 for p in full.history.phases[1:])
        assert full.history.phases[-1]["end_epoch"] > 4 or not below  # (it trains longer)
        done = pipe().fit(4, client=client, resume=True, **folder)
        assert (
            done.history.info["already_finished"]["epoch"] == full.history.phases[-1]["end_epoch"]
        )
        assert len(done.history.steps) == len(full.history.steps)
        _assert_same_weights(full.model, done.model)


def test_checkpoint_every_is_checked_before_any_work(tmp_path):
    x, y = make_data(64)
    pipe = _pipeline(x, y)
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        pipe.fit(1, checkpoint_every=5)
    for bad in (0, -1, 2.5, "10", True):
        with pytest.raises(ConfigError, match="checkpoint_every"):
            pipe.fit(1, checkpoint_dir=tmp_path, checkpoint_every=bad)


def _plan(windows: int, steps_per_window: int) -> Plan:
    steps = tuple(
        StepSpec(
            index=i,
            epoch=0,
            step_in_epoch=i,
            start=0,
            global_batch=2,
            local_batches=(1, 1),
            last_in_epoch=False,
        )
        for i in range(windows * steps_per_window)
    )
    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=2)
    return Plan.build(
        ("Load",), phase, steps, 2, step_seconds=0.25, window_seconds=0.25 * steps_per_window
    )


def test_checkpoint_windows_every_nth_never_the_phase_end():
    plan = _plan(windows=10, steps_per_window=3)  # steps 0-29, windows of 3
    marked, left = checkpoint_windows(plan, every=4, countdown=4, phase_stop=30)
    assert sorted(marked) == [3, 7]  # window 11 would be the 12th; 9 ends the phase
    assert left == 2
    # the countdown carries over to the next plan of the phase (after calibration)
    marked, left = checkpoint_windows(plan, every=4, countdown=1, phase_stop=100)
    assert sorted(marked) == [0, 4, 8]
    # a window that ends the phase is left to the phase-boundary checkpoint
    marked, _ = checkpoint_windows(plan, every=10, countdown=10, phase_stop=30)
    assert marked == frozenset()
    marked, _ = checkpoint_windows(plan, every=1, countdown=1, phase_stop=30)
    assert sorted(marked) == list(range(9))
