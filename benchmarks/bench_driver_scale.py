"""The driver at scale: the fit state machine, the planner and the recorder against a
simulated cluster of 64, 256 and 1,024 replicas (no processes, no network).

The simulated executor (``dataflow.driver.simulate``) answers every command at
once and hands back window results built from the plan, with each replica's
sample indices (so the ledger records them, as in a real fit). What is timed is
the driver's own CPU (``time.process_time`` minus the simulator's; tracemalloc off), per *window
round* (one window committed on every replica: the unit a real fit pays once per
``window_seconds``) and per phase, plus the peak memory the driver allocates
(tracemalloc). Each replica count runs twice, with ``--rounds`` and 4x as many
window rounds per phase: the difference is the per-round cost (what a long phase
pays), the rest the per-phase cost (planning the phase, laying out its epoch
streams for the ledger). Target (issue 14): <= 10 ms of driver CPU per window
round at 1,024 replicas, i.e. <= 1 % of 1 s windows.

    python benchmarks/bench_driver_scale.py            # ~1 minute on 2 cores
    python benchmarks/bench_driver_scale.py --replicas 64 256 --rounds 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

import dataflow as dfl
from dataflow.driver.fit import build_loop
from dataflow.driver.simulate import SimulatedExecutor

RESULTS = Path(__file__).resolve().parent / "results" / "driver_scale.json"


def measure(
    replicas: int, rounds: int, local_batch: int, phases: int, trace_memory: bool = False
) -> dict:
    """``phases`` phases of ``rounds`` windows each (1-step windows: the worst case
    for the driver, as every step is a window round), ``local_batch`` per replica."""
    batch = replicas * local_batch
    samples = batch * rounds  # one epoch per phase
    x = np.zeros((samples, 1), dtype=np.float32)
    pipe = dfl.Pipeline(
        model=lambda: torch.nn.Linear(1, 1),
        loss=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        source=dfl.io.ArraySource(x, x),
        schedule=dfl.schedule.Fixed(batch, epochs_per_phase=1),
        progress=False,
        # a window per step: each step is a round the driver commits
        window_seconds=1e-9,
    )
    trainer = pipe.trainer
    workers = [f"tcp://10.0.{r // 250}.{r % 250}:9000" for r in range(replicas)]
    executor = SimulatedExecutor(workers, load=trainer.load, step_seconds=lambda w: 1.0)
    loop = build_loop(
        trainer, executor, epochs=phases, order=trainer.graph.validate(replicas=replicas)
    )
    if trace_memory:
        tracemalloc.start()
    cpu, wall = time.process_time(), time.perf_counter()
    loop.run(workers)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = 0
    if trace_memory:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    driver = cpu - executor.own_seconds
    steps = len(loop.recorder.history.steps)
    windows = sum(p["windows"] for p in loop.recorder.history.phases)
    return {
        "replicas": replicas,
        "phases": phases,
        "window_rounds": windows,
        "steps": steps,
        "driver_cpu_s": driver,
        "simulator_cpu_s": executor.own_seconds,
        "driver_ms_per_window_round": 1e3 * driver / windows,
        "driver_ms_per_phase": 1e3 * driver / phases,
        "share_of_1s_windows": driver / windows,
        "peak_memory_mb": peak / 2**20,
        "wall_s": wall,
    }


def split_costs(short: dict, long: dict) -> dict:
    """Per round and per phase, from two runs that differ only in rounds per phase."""
    rounds = (long["window_rounds"] - short["window_rounds"]) / short["phases"]
    per_round = (long["driver_cpu_s"] - short["driver_cpu_s"]) / (short["phases"] * rounds)
    per_phase = short["driver_cpu_s"] / short["phases"] - per_round * (
        short["window_rounds"] / short["phases"]
    )
    return {
        "replicas": short["replicas"],
        "driver_ms_per_window_round": 1e3 * per_round,
        "driver_ms_per_phase_fixed": 1e3 * per_phase,
        "share_of_1s_windows": per_round,
        "peak_memory_mb": None,
        "runs": [short, long],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=10, help="window rounds per phase")
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--local-batch", type=int, default=4)
    args = parser.parse_args(argv)
    rows = []
    print(f"{'replicas':>8} {'ms/round':>9} {'ms/phase':>9} {'of 1 s':>7} {'peak MB':>8}")
    for replicas in args.replicas:
        short = measure(replicas, args.rounds, args.local_batch, args.phases)
        long = measure(replicas, 4 * args.rounds, args.local_batch, args.phases)
        row = split_costs(short, long)
        # CPU without tracemalloc (it slows allocations); memory in a run of its own
        row["peak_memory_mb"] = measure(
            replicas, 4 * args.rounds, args.local_batch, args.phases, trace_memory=True
        )["peak_memory_mb"]
        rows.append(row)
        print(
            f"{replicas:>8} {row['driver_ms_per_window_round']:>9.2f} "
            f"{row['driver_ms_per_phase_fixed']:>9.1f} {100 * row['share_of_1s_windows']:>6.2f}% "
            f"{row['peak_memory_mb']:>8.1f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"saved {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
