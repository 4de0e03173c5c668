"""Checkpoints at phase boundaries, and exact resume after the driver process is killed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_driver import data, pipeline

from dataflow.checkpoint import CheckpointStore
from dataflow.errors import ConfigError, IncompatibleCheckpointError
from dataflow.history.report import step_wall_times

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_a_killed_driver_resumes_bit_identical_to_an_uninterrupted_run(client, tmp_path):
    epochs = 4
    driver = subprocess.Popen(
        [sys.executable, str(HERE / "resume_driver.py"), str(tmp_path), str(epochs)],
        cwd=HERE,
        start_new_session=True,  # its LocalCluster's worker processes die with it
    )
    store = CheckpointStore(tmp_path)
    try:
        deadline = time.monotonic() + 240
        while len(store.checkpoints()) < 2 and driver.poll() is None:
            assert time.monotonic() < deadline, "the driver wrote no checkpoint in time"
            time.sleep(0.05)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the whole driver, mid-fit
        driver.wait()
    assert driver.returncode == -signal.SIGKILL, "the fit ended before it could be killed"
    saved = store.load_latest()
    assert 2 <= saved.epoch < epochs

    x, y = data()
    resumed = pipeline(x, y).fit(epochs, client=client, checkpoint_dir=tmp_path, resume=True)
    uninterrupted = pipeline(x, y).fit(epochs, client=client)
    assert resumed.history.info["resumed_from"]["epoch"] == saved.epoch
    for name, tensor in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    # the history and the ledger cover the whole run, before and after the kill
    assert [p["start_epoch"] for p in resumed.history.phases] == list(range(epochs))
    assert len(resumed.history.steps) == len(uninterrupted.history.steps)
    for epoch in range(epochs):
        assert resumed.ledger.consumed(epoch).tolist() == list(range(len(x)))


def test_a_resumed_fit_counts_time_and_throughput_over_its_runs(client, tmp_path):
    """Trained 2 epochs, then resumed to 4: the history keeps each run as a segment, the
    resumed steps' times go on from the first run's, and the summary's samples/s is
    every sample over both runs' seconds (not over the resumed run's alone)."""
    x, y = (a[:256] for a in data())
    first = pipeline(x, y).fit(2, client=client, checkpoint_dir=tmp_path)
    resumed = pipeline(x, y).fit(4, client=client, checkpoint_dir=tmp_path, resume=True)
    history, split = resumed.history, len(first.history.steps)
    segments = history.info["segments"]
    assert [(s["run"], s["start_step"], s["end_step"]) for s in segments] == [
        (0, 0, split),
        (1, split, len(history.steps)),
    ]
    assert segments[0]["run_id"] == first.history.info["run_id"]
    assert segments[1]["run_id"] == history.info["run_id"] != segments[0]["run_id"]
    samples = [s["samples"] for s in history.steps]
    assert [s["samples"] for s in segments] == [sum(samples[:split]), sum(samples[split:])]
    # the first run's part up to its checkpoint (its last steps' times, then the write)
    assert first.history.steps[-1]["time"] <= segments[0]["seconds"]
    assert segments[0]["seconds"] <= first.history.info["train_seconds"]
    # step times go on across the seam: the resumed run's start after the first run's
    times = np.array([s["time"] for s in history.steps])
    assert (np.diff(times) >= 0).all()
    assert times[split] >= segments[0]["seconds"]
    assert [s["time"] for s in history.steps[:split]] == [s["time"] for s in first.history.steps]
    # the wall time each run's training ended, after the run began
    for run, result in zip(segments, (first, resumed), strict=True):
        assert result.history.info["finished_at"] >= run["started_at"]
    total = sum(s["seconds"] for s in segments)
    assert history.info["train_seconds"] == pytest.approx(total)
    assert total > segments[1]["seconds"]
    # the report's wall-time axis is monotonic, the summary counts both runs
    assert (np.diff(step_wall_times(history.steps)) >= 0).all()
    headline = resumed.summary().splitlines()[0]
    assert f"in {total:.1f} s over 2 runs ({sum(samples) / total:.0f} samples/s)" in headline


def test_resume_refuses_another_model_and_needs_a_folder(client, tmp_path):
    x, y = data()
    finished = pipeline(x, y).fit(1, client=client, checkpoint_dir=tmp_path)
    other = pipeline(x[:512], y[:512])
    with pytest.raises(IncompatibleCheckpointError, match="samples"):
        other.fit(2, client=client, checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        pipeline(x, y).fit(2, client=client, resume=True)
    # the same command again (a job requeued after its fit ended): the finished result,
    # from the last checkpoint, with no cluster started (client=None) and nothing trained
    again = pipeline(x, y).fit(1, checkpoint_dir=tmp_path, resume=True)
    assert again.history.info["already_finished"]["epoch"] == 1
    assert "already finished: returned from" in again.summary()
    for name, tensor in finished.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name
    assert again.history.steps == finished.history.steps
    assert again.history.epochs == finished.history.epochs
    assert sorted(again.ledger.consumed(0).tolist()) == list(range(len(x)))
    runs = [(r["run_id"], r["end_step"]) for r in finished.history.info["segments"]]
    assert [(r["run_id"], r["end_step"]) for r in again.history.info["segments"]] == runs


def test_a_resumed_history_holds_one_record_type_per_section(client, tmp_path):
    """The rows restored from the checkpoint are records like the rows trained after it:
    ``e.train_loss`` works on every epoch of a resumed fit, as on a fresh one."""
    from dataflow.history.records import EpochRecord, PhaseRecord, StepRecord

    x, y = (a[:128] for a in data())
    first = pipeline(x, y).fit(1, client=client, checkpoint_dir=tmp_path)
    history = pipeline(x, y).fit(2, client=client, checkpoint_dir=tmp_path, resume=True).history
    assert {type(s) for s in history.steps} == {StepRecord}
    assert {type(p) for p in history.phases} == {PhaseRecord}
    assert [type(e) for e in history.epochs] == [EpochRecord, EpochRecord]
    assert history.epochs[0].train_loss == first.history.epochs[0].train_loss
    assert [s.step for s in history.steps] == list(range(len(history.steps)))
