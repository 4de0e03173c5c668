"""No host read of a step's result in a steady step (issue 37, item 1), checked on the CPU.

On a GPU every read of a device tensor's value on the host (``.item()``, ``float()``,
``bool()``, ``.tolist()``, ``.cpu()``) waits for every kernel queued before it, so the
host can no longer queue the next step while this one runs. The engine reads what it
needs (losses, the non-finite verdict, timings) once per window. These tests count
such reads, inside the stages of each step, with a ``TorchFunctionMode`` opened after
Load and closed after Update: a per-step read that comes back fails here, without a GPU.

``check="window"`` is what ``Update(check="auto")`` picks on a GPU; on the CPU it picks
``"step"`` (a read costs nothing there). ``Async`` is left out: it ships each step's
gradient to the host-resident parameter store by design.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
from conftest import TinyCNN, make_data, sgd
from torch.overrides import TorchFunctionMode

import dataflow as dfl
from dataflow import stages
from dataflow.core.precision import SIMULATE_CAPTURE_ENV

pytestmark = pytest.mark.slow  # real worker processes

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu"}


class HostReads(TorchFunctionMode):
    """Every host read of a tensor's value while it is active, with where it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            frames = traceback.extract_stack(limit=6)[:-1]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
            self.seen.append(f"{name} at {where}")
        return func(*args, **(kwargs or {}))


class OpenCount(stages.Stage):
    def __init__(self) -> None:
        super().__init__("OpenCount")

    def run(self, step: stages.StepContext, batch: stages.Batch) -> stages.Batch:
        mode = HostReads()
        mode.__enter__()
        step.metrics["_host_reads"] = mode
        return batch


class CloseCount(stages.Stage):
    """Appends ``{"step", "rank", "seen"}`` to ``path`` (JSON lines) after each step."""

    def __init__(self, path: str) -> None:
        super().__init__("CloseCount")
        self.path = path

    def run(self, step: stages.StepContext, value):
        mode = step.metrics.pop("_host_reads")
        mode.__exit__(None, None, None)
        record = {"step": step.spec.index, "rank": step.replica.rank, "seen": mode.seen}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return value


def counted_fit(client, path: Path, **options) -> tuple[dfl.FitResult, list[dict]]:
    x, y = make_data(192)
    g = dfl.Graph()
    batch = g.add(OpenCount(), g.add(stages.Load(dfl.io.ArraySource(x, y))))
    out = g.add(stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    reduced = g.add(stages.AllReduce(), g.add(stages.Backward(), out))
    # clipping too: its norm and factor stay on the device, read with the window's losses
    update = stages.Update(sgd, check="window", clip_grad_norm=0.05)
    g.add(CloseCount(str(path)), g.add(update, reduced))
    trainer = dfl.Trainer(g, device="cpu", progress=False, **options)
    result = trainer.fit(epochs=2, client=client)
    return result, [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(
            dict(
                schedule=dfl.schedule.Adaptive(8, max_batch=64),
                window_steps=4,
                precision="bf16",
                max_micro_batch=4,
            ),
            id="sync-adaptive-bf16-microbatches",
        ),
        pytest.param(
            dict(schedule=dfl.schedule.Fixed(16), sync=dfl.sync.Local(period_steps=4)),
            id="local",
        ),
        pytest.param(  # replayed steps (on the CPU: the capture's bookkeeping, simulated)
            dict(
                schedule=dfl.schedule.Stepwise({0: 16, 1: 32}),
                capture=True,
                precision="bf16",
                max_micro_batch=8,  # phase 1: two micro-batches a step, replayed too
            ),
            id="captured-bf16",
        ),
    ],
)
def test_no_steady_step_reads_its_result_on_the_host(client, tmp_path, monkeypatch, options):
    if options.get("capture"):
        monkeypatch.setenv(SIMULATE_CAPTURE_ENV, "1")
    result, records = counted_fit(client, tmp_path / "reads.jsonl", **options)
    if options.get("capture"):
        assert sum(sum(p.captured_steps) for p in result.history.phases) > 0
    steps = result.history.steps
    assert all(s["grad_norm"] > 0.05 for s in steps)  # every step clipped
    counted = {(r["step"], r["rank"]) for r in records}  # (and the driver's dry run)
    assert counted == {(s["step"], rank) for s in steps for rank in (0, 1)}
    first_of_phase = {
        min(s["step"] for s in steps if s["phase"] == p["phase"]) for p in result.history.phases
    }
    reads = {
        (r["step"], r["rank"]): r["seen"]
        for r in records
        if r["seen"] and r["step"] not in first_of_phase  # the label check reads once
    }
    assert reads == {}
