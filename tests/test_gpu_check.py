"""benchmarks/gpu_check.sh, dry-run on the CPU: it must never first break on a lent GPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_lists_every_step(tmp_path):
    env = {**os.environ, "DATAFLOW_GPU_CHECK_DRY": "1", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [line[3:].split(":")[0] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert [s for s in steps if s != "wheels"] == [
        "install",
        "versions",
        "gpu_tests",
        "bench",
        "profile",
        "gpu_check",
    ]
    assert f"--out {tmp_path}/gpu.json" in done.stdout


def test_bench_gpu_parses_its_arguments_without_a_gpu():
    """The script imports and parses on a CPU machine (its sides are named by --loops)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT / "benchmarks",
    )
    assert done.returncode == 0, done.stderr
    assert "torch_loop_resident_bf16_cl_compiled" in done.stdout
