"""What a user reads in the terminal: the phase's plan line before its progress bar (as
many steps as the bar counts), the held-out loss next to the metrics asked for, rounded
figures, and an error raised on a worker shown once.

Each runs a script in a fresh interpreter with an embedded LocalCluster, as a user does
(``python examples/quickstart.py``), and reads its output: slow. The fit's summary is
also read from a history built here (fast).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(args: list[str], cwd: Path, timeout: float = 280) -> subprocess.CompletedProcess:
    """stdout and stderr in one stream, in the order they were written (unbuffered)."""
    return subprocess.run(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.slow
def test_quickstart_prints_its_plan_before_the_bar_and_rounded_metrics(tmp_path):
    done = run([str(EXAMPLES / "quickstart.py"), "--epochs", "1"], tmp_path)
    out = done.stdout
    assert done.returncode == 0, out[-3000:]
    # the plan line comes once, before the bar, and counts the bar's steps (with the
    # one-step calibration windows)
    plans = re.findall(r"Plan, phase 0: .*?, (\d+) steps in windows of about", out)
    assert len(plans) == 1, out[-3000:]
    assert out.index("Plan, phase 0:") < out.index("phase 0 (B=64)")
    totals = set(re.findall(r"phase 0 \(B=64\):.*?\| *\d+/(\d+) \[", out))
    history = json.loads((tmp_path / "runs" / "quickstart" / "history.json").read_text())
    assert totals == set(plans) == {str(len(history["steps"]))}
    # metrics={"accuracy": ...} keeps the held-out loss too
    last = history["epochs"][-1]
    assert {"eval_loss", "eval_accuracy"} <= set(last)
    epoch_line = next(line for line in out.splitlines() if line.startswith("  epoch 0:"))
    assert "eval_loss" in epoch_line and "eval_accuracy" in epoch_line
    final = out.strip().splitlines()[-1]
    assert re.fullmatch(r"final held-out accuracy \d{1,3}\.\d%, loss \d+\.\d{3}", final), final
    # keep_best="eval_accuracy": the summary and the example name the kept epoch
    best = history["info"]["best"]
    assert (best["metric"], best["epoch"], best["value"]) == (
        "eval_accuracy",
        0,
        last["eval_accuracy"],
    )
    assert f"best eval_accuracy {best['value']:.4g} after epoch 0 (result.best_model)" in out
    kept_line = out.strip().splitlines()[-2]
    assert kept_line == f"best held-out accuracy {best['value']:.1%} after epoch 0"
    assert final.startswith(f"final held-out accuracy {last['eval_accuracy']:.1%}")


FAILS_ON_A_WORKER = '''
import distributed
import numpy as np
import torch

import dataflow as dfl


class FailsOnAWorker(torch.nn.Module):
    """Trains in the driver's dry run, raises on a Dask worker."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        try:
            distributed.get_worker()
        except ValueError:  # not on a worker
            return self.lin(x)
        raise ValueError("boom on the worker")


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    dfl.Pipeline(
        model=FailsOnAWorker,
        device="cpu",
        loss=torch.nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        source=dfl.io.ArraySource(x, rng.integers(0, 3, size=64)),
        schedule=dfl.schedule.Fixed(16),
    ).fit(1)
'''


@pytest.mark.slow
def test_an_error_on_a_worker_is_shown_once(tmp_path):
    """Not also as distributed's "Compute Failed" log block (an escaped traceback) per
    replica: the fit raises it once, with the worker's traceback as its cause."""
    script = tmp_path / "fails_on_a_worker.py"
    script.write_text(FAILS_ON_A_WORKER)
    done = run([str(script)], tmp_path)
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert "Compute Failed" not in out, out[-3000:]
    assert out.count("dataflow.core.errors.ReplicaError: replica") == 1, out[-3000:]
    # the worker's error: its traceback's last line and the ReplicaError's message
    assert out.count("ValueError: boom on the worker") == 2, out[-3000:]
    # ... which says where it failed: the stage, the replica and the step
    last = out.rstrip().splitlines()[-1]
    assert re.search(
        r"failed \(in stage 'Forward' on replica \d, step \d+\): ValueError: boom on the worker$",
        last,
    ), out[-3000:]


def test_the_summary_rounds_its_floats():
    """A square-root-scaled LR is printed as ``lr 0.02828``, not to 17 digits."""
    from test_report import adaptive_history

    from dataflow.history.result import FitResult

    history = adaptive_history()
    history.phases[1]["lr"] = 0.02 * 2**0.5
    text = FitResult(model=None, history=history).summary()  # type: ignore[arg-type]
    line = next(line for line in text.splitlines() if line.startswith("  phase 1:"))
    assert ", lr 0.02828, split" in line, line
    assert "0.028284" not in text


def test_the_summary_names_the_workers_that_joined():
    """Joins (a scaled cluster, a worker readmitted) were in ``history.info`` only."""
    from test_report import adaptive_history

    from dataflow.history.result import FitResult

    history = adaptive_history()
    history.info["regroups"] = [
        {"phase": 1, "replicas": 3, "joined": ["tcp://a:1"]},
        {"phase": 2, "replicas": 5, "joined": ["tcp://b:1", "tcp://c:1"]},
    ]
    text = FitResult(model=None, history=history).summary()  # type: ignore[arg-type]
    expected = (
        "  workers joined: 1 at phase 1 (3 replicas on); 2 at phase 2 (5 replicas on) "
        "(history.info['regroups'])"
    )
    assert expected in text.splitlines(), text
    del history.info["regroups"]
    assert "joined" not in FitResult(model=None, history=history).summary()  # type: ignore[arg-type]


def test_a_replica_error_is_not_logged_again_by_the_worker_of_any_cluster():
    """The fit raises a replica's error on the driver; the worker that ran the replica
    drops distributed's "Compute Failed" record of it (the engine's tasks only), on a
    cluster the user started too (dask-mpi, dask-jobqueue), not only the embedded one:
    the worker plugin every fit installs adds the filter."""
    import logging

    from distributed import Client, LocalCluster

    from dataflow.runtime.plugin import plugin_of

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    logger = logging.getLogger("distributed.worker")
    seen = Seen()
    logger.addHandler(seen)
    try:
        with (
            LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            client.run(lambda dask_worker: plugin_of(dask_worker) and None)
            engine = "Load+Forward@replica1-train-fit0123456789ab-p0w3"
            logger.error("Compute Failed\nKey:       %s\n", engine)
            logger.error("Compute Failed\nKey:       %s\n", "my-own-task-123")
    finally:
        logger.removeHandler(seen)
        for quiet in [f for f in logger.filters if type(f).__name__ == "QuietEngineFailures"]:
            logger.removeFilter(quiet)
    failed = [m for m in seen.messages if m.startswith("Compute Failed")]
    assert failed == ["Compute Failed\nKey:       my-own-task-123\n"]
