"""The driver grows linearly with the replicas: a fit of 4,096 simulated replicas runs at
most about 4x the driver's Python lines of one of 1,024 (issue 38, item 6).

Counted, not timed: ``sys.settrace`` counts each line the driver's own modules (the
machine, loop, recorder, planner, sample check, ledger, layout) execute in a whole
simulated fit, the simulator's lines left out. A quadratic step (a membership test
against a tuple rebuilt per worker was one) makes the ratio 16x, not 4x, on any
machine, loaded or not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_driver_simulated import trainer as simulated_trainer

import dataflow as dfl
from dataflow.driver.fit import build_loop
from dataflow.driver.simulate import SimulatedExecutor

pytestmark = pytest.mark.slow  # ~10 s of traced Python

ROOT = Path(dfl.__file__).resolve().parent.parent
COUNTED = ("dataflow/driver/", "dataflow/planning/", "dataflow/history/", "io/ledger.py")
NOT_COUNTED = ("dataflow/driver/simulate.py",)


def counted_lines(replicas: int, rounds: int = 3, local_batch: int = 2) -> int:
    """Lines of the driver's modules executed by one simulated fit of one phase of
    ``rounds`` one-step windows (every step a window round, the driver's worst case)."""
    batch = replicas * local_batch
    trainer = simulated_trainer(batch * rounds, schedule=dfl.schedule.Fixed(batch), window_steps=1)
    workers = [f"tcp://10.0.{r // 250}.{r % 250}:9000" for r in range(replicas)]
    executor = SimulatedExecutor(workers, load=trainer.load, step_seconds=lambda w: 1.0)
    loop = build_loop(trainer, executor, epochs=1, order=trainer.graph.validate(replicas=replicas))
    files: dict[str, bool] = {}
    lines = 0

    def counted(filename: str) -> bool:
        known = files.get(filename)
        if known is None:
            path = Path(filename).as_posix()
            known = files[filename] = any(c in path for c in COUNTED) and not any(
                n in path for n in NOT_COUNTED
            )
        return known

    def line(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return line

    def call(frame, event, arg):
        return line if counted(frame.f_code.co_filename) else None

    sys.settrace(call)
    try:
        loop.run(workers)
    finally:
        sys.settrace(None)
    assert len(loop.recorder.history.steps) == rounds
    return lines


def test_the_driver_runs_linear_in_the_replicas():
    small, large = counted_lines(1024), counted_lines(4096)
    assert large <= 4.5 * small, (small, large, large / small)
