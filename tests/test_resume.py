"""Checkpoints at phase boundaries, and exact resume after the driver process is killed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from resume_driver import data, pipeline

from dataflow.checkpoint import CheckpointStore
from dataflow.errors import ConfigError, IncompatibleCheckpointError

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


def test_resume_refuses_another_model_and_needs_a_folder(client, tmp_path):
    x, y = data()
    pipeline(x, y).fit(1, client=client, checkpoint_dir=tmp_path)
    other = pipeline(x[:512], y[:512])
    with pytest.raises(IncompatibleCheckpointError, match="samples"):
        other.fit(2, client=client, checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        pipeline(x, y).fit(2, client=client, resume=True)
    with pytest.raises(ConfigError, match="already at epoch 1"):
        pipeline(x, y).fit(1, client=client, checkpoint_dir=tmp_path, resume=True)
