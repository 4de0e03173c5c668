"""Measuring on a shared machine: wait until other programs leave it quiet, rerun a
side they disturbed, and report each side's CPU use per process."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from records import table

from dataflow.tools.cpu_meter import CpuMeter


def _sample_busy(seconds: float) -> float:
    """Cores kept busy by other programs over ``seconds`` (this process sleeping)."""
    with CpuMeter() as meter:
        time.sleep(seconds)
    return meter.foreign_cpu_seconds / meter.wall_seconds


def wait_quiet(max_wait: float, *, cores: float = 0.15, sample: float = 2.0) -> float:
    """Wait (up to ``max_wait`` s) until other programs use < ``cores`` cores; returns it."""
    deadline = time.monotonic() + max_wait
    while True:
        load = _sample_busy(sample)
        if load < cores or time.monotonic() >= deadline:
            return load
        print(f"    machine busy ({load:.2f} cores used by others); waiting ...", flush=True)


def measure_side(
    name: str, fn: Callable[[], Any], *, retries: int, max_wait: float, max_foreign: float
) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` when the machine is quiet; rerun it if others used CPU meanwhile.

    ``max_foreign``: cores used by other programs, averaged over the run, above which
    the run is considered disturbed. The last attempt is kept in any case, flagged.
    """
    attempts = []
    for attempt in range(retries + 1):
        before = wait_quiet(max_wait)
        print(f"  running {name} (attempt {attempt + 1}) ...", flush=True)
        with CpuMeter() as meter:
            value = fn()
        foreign = meter.foreign_cpu_seconds / meter.wall_seconds
        attempts.append(
            {
                **meter.as_dict(),
                "foreign_cores": foreign,
                "idle_before": before,
                "steady_threads": meter.threads_between(*STEADY_SPAN),
            }
        )
        if foreign <= max_foreign:
            break
        print(f"    disturbed: other programs used {foreign:.2f} cores meanwhile", flush=True)
    return value, {"attempts": attempts, "disturbed": foreign > max_foreign}


# The part of a side's wall time (start, stop as fractions) in which its per-thread CPU
# use is reported: well inside the training on both sides (dataflow's cluster start-up
# and setup, and the baselines' process start, come before it).
STEADY_SPAN = (0.35, 0.85)


def print_threads(quiet: dict[str, Any]) -> None:
    """The per-process CPU table of each side's kept attempt, in steady training."""
    rows = []
    for side, q in quiet.items():
        for row in q["attempts"][-1]["steady_threads"]:
            rows.append(
                [
                    side,
                    row["process"],
                    f"{row['cores']:.3f}",
                    f"{row['busiest_thread']:.3f}",
                    f"{row['other_threads']:.3f}",
                    row["threads"],
                ]
            )
    span = f"{STEADY_SPAN[0]:.0%}-{STEADY_SPAN[1]:.0%}"
    print(f"CPU cores used per process during steady training ({span} of each side's wall):")
    header = ["side", "process", "cores", "busiest thread", "other threads", "threads"]
    print(table(rows, header))
