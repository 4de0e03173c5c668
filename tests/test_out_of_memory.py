"""Batches that fit: an out-of-memory error in a window halves the micro-batch cap, and
the fit redoes the rest of the phase from the commit as smaller micro-batches.

The machine's decisions as scripted events (milliseconds), the planner's caps, and
one real LocalCluster fit whose model runs out of memory above K samples.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TinyCNN, make_data, max_abs_diff, reference_training, tiny_pipeline
from test_driver_machine import PHASE0, Driver, W, of, result

import dataflow as dfl
from dataflow.core.phase import PhaseSpec
from dataflow.driver import commands as cmd
from dataflow.driver import events as ev
from dataflow.driver.memory import halved_cap, is_out_of_memory, measured_cap, memory_cap
from dataflow.driver.segments import Planner
from dataflow.errors import ReplicaError
from dataflow.runtime.device_memory import MemoryProbe
from dataflow.schedule.balance import Even

OOM = MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # the machine sees a flag


def planner(cap=None) -> Planner:
    return Planner(schedule=None, balancer=Even(), num_samples=32, max_micro_batch=cap)


def oom(d: Driver, submit: cmd.SubmitWindows, window: int = 0, rank: int = 1) -> list:
    return d.send(
        ev.WindowFailed(d.state.generation, rank, submit.first_window + window, OOM, False, True)
    )


def replan(d: Driver, plan_cmd: cmd.PlanSegment) -> list:
    """The planner's answer to ``plan_cmd`` (the rest of PHASE0 from its commit)."""
    todo = planner().rest(d.state.segment, plan_cmd.commit_step, 2, plan_cmd.memory_cap)
    return d.send(ev.SegmentPlanned(PHASE0, d.state.phase_steps, todo, continued=True))


def test_out_of_memory_halves_the_cap_regroups_rolls_back_and_replans_the_rest():
    d = Driver()
    _, submit = d.start()  # batch 8 on 2 replicas: 4 samples each, one micro-batch
    d.finish_plan(submit, upto=1)  # step 0 commits
    out = oom(d, submit, window=1)
    kinds = [cmd.RecordFailure, cmd.StopWindows, cmd.RollBack, cmd.FormGroup]
    assert [type(c) for c in out] == kinds
    record = out[0].record
    assert record["reason"] == "out-of-memory" and record["rank"] == 1
    assert (record["micro_batch"], record["micro_batch_cap"]) == (4, 2)
    assert record["commit_step"] == 1 and record["lost"] == []
    stop, rollback, form = out[1:]
    # The failed replica broke the collective its peers waited in: a new group, no one lost
    assert stop.leave_group and rollback.leave_group and rollback.step == 1
    assert form.members == W[:2] and form.generation == 1 and not form.fresh
    assert form.joining == ()
    [plan_cmd] = d.send(ev.GroupFormed(1))
    assert dataclasses.replace(plan_cmd, segment=(), phase_steps=()) == cmd.PlanSegment(
        "rest", 2, PHASE0, 1, memory_cap=2
    )
    assert plan_cmd.segment and plan_cmd.phase_steps  # what the re-split needs
    begin, again = replan(d, plan_cmd)
    assert begin.continued and again.generation == 1 and again.members == W[:2]
    assert [s.micro_batches for s in begin.steps] == [(2, 2)] * 7  # 4 samples, cap 2
    assert begin.steps[0].index == 1


def test_the_learned_cap_stays_for_the_fits_later_phases():
    d = Driver()
    _, submit = d.start()
    oom(d, submit)
    [plan_cmd] = d.send(ev.GroupFormed(1))
    _, submit = replan(d, plan_cmd)
    [train] = of(cmd.SubmitWindows, d.finish_plan(submit))
    d.finish_plan(train)
    d.send(ev.PhaseEnded(1, ({"weights_digest": "x"},) * 2))
    phase1 = PhaseSpec(index=1, start_epoch=2, end_epoch=3, global_batch=16)
    [plan_cmd] = d.send(ev.PhaseChosen(phase1))
    assert plan_cmd == cmd.PlanSegment("phase", 2, phase1, 8, memory_cap=2)
    steps = planner().phase_steps(phase1, 2, 8, memory_cap=plan_cmd.memory_cap)
    assert {s.micro_batches for s in steps} == {(4, 4)}
    d.send(ev.SegmentPlanned(phase1, steps, steps))
    assert d.state.memory_halvings == 0  # the budget is per phase; the cap is the fit's
    assert d.state.memory_cap == 2


def test_a_resumed_fit_starts_with_the_cap_its_checkpoint_kept():
    d = Driver()
    d.send(ev.Started(tuple(W[:2]), restore=True, memory_cap=2))
    assert d.send(ev.GroupFormed(0)) == [cmd.ChoosePhase()]
    [plan_cmd] = d.send(ev.PhaseChosen(PHASE0))
    assert plan_cmd == cmd.PlanSegment("phase", 2, phase=PHASE0, memory_cap=2)


def test_past_the_halving_budget_the_fit_fails_naming_the_cap():
    d = Driver(max_memory_halvings=1)
    _, submit = d.start()
    oom(d, submit)
    _, submit = replan(d, d.send(ev.GroupFormed(1))[0])
    [fail] = oom(d, submit, rank=0)
    assert isinstance(fail, cmd.Fail) and isinstance(fail.error, ReplicaError)
    message = str(fail.error)
    assert "replica 0 ran out of device memory in phase 0" in message
    assert "micro-batches of 2 samples, after 1 halvings" in message
    assert "max_micro_batch" in message and fail.error.__cause__ is OOM
    assert d.state.status == "failed"


def test_when_one_sample_does_not_fit_the_fit_fails_at_once():
    d = Driver()
    tiny = PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=2)  # 1 sample each
    _, submit = d.start(phase=tiny)
    [fail] = oom(d, submit)
    assert "micro-batches of 1 sample" in str(fail.error)


def test_out_of_memory_of_a_stale_window_is_ignored():
    d = Driver()
    _, submit = d.start()
    oom(d, submit)
    assert oom(d, submit) == []  # a window the recovery dropped


def test_the_users_max_micro_batch_stays_an_upper_bound():
    count = planner(cap=3).micro_batches(2, memory_cap=4)
    assert count((16, 16), 0) == (6, 6)  # 3 per micro-batch: the user's cap is tighter
    assert planner().micro_batches(2, memory_cap=4)((16, 16), 0) == (4, 4)
    per_replica = Planner(
        schedule=None, balancer=Even(), num_samples=32, max_micro_batch=(8, 2)
    ).micro_batches(2, memory_cap=4)
    assert per_replica((16, 16), 0) == (4, 8)
    assert planner(cap=3).micro_batches(2)((16, 16), 0) == (6, 6)


def test_halving_starts_from_what_ran():
    assert halved_cap(16, None) == 8
    assert halved_cap(5, 8) == 2
    assert halved_cap(1, None) == 0


def test_out_of_memory_is_named_by_torchs_error_and_what_it_caused():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    wrapped = ReplicaError("replica 1 on worker w failed")
    wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory")
    assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("CUDA out of memory"))
    assert not is_out_of_memory(None)


def test_a_measured_peak_per_sample_caps_the_micro_batch_at_a_safe_fraction():
    mib, gib = 2**20, 2**30
    # 10 GiB free, 80 % of it usable, 1 GiB of it the step's own, 96 MiB per sample:
    # 7 GiB / 96 MiB = 74.7 samples
    assert memory_cap(96 * mib, 10 * gib, base_bytes=1 * gib) == 74
    assert memory_cap(96 * mib, 10 * gib, fraction=0.5) == 53
    assert memory_cap(20 * gib, 10 * gib) == 1  # never below one sample
    assert memory_cap(0, 10 * gib) is None  # nothing measured


def measured(peak: float, samples: int, usable: float) -> dict[str, float]:
    return {"peak_bytes": peak, "samples": float(samples), "usable_bytes": usable}


def finish_measured(d: Driver, submit: cmd.SubmitWindows, memory: dict) -> list:
    """The calibration windows finish; the first one's results carry ``memory``."""
    out = []
    for window in submit.plan.windows:
        results = {}
        for r in range(2):
            got = result(r, submit.plan, window)
            results[r] = dataclasses.replace(got, memory=memory) if window.index == 0 else got
        out += d.send(
            ev.WindowDone(d.state.generation, submit.first_window + window.index, results)
        )
    return out


def test_a_phases_first_window_on_cuda_caps_the_rest_of_it_by_its_measured_memory():
    d = Driver()
    _, submit = d.start()  # 4 samples per replica at once
    # 250 bytes per sample; 80 % of 700 usable bytes holds 2 samples
    out = finish_measured(d, submit, measured(1000.0, 4, 700.0))
    assert of(cmd.SubmitWindows, out) == []
    assert dataclasses.replace(out[-1], segment=(), phase_steps=()) == cmd.PlanSegment(
        "rest", 2, PHASE0, 2, memory_cap=2
    )
    assert out[-1].segment and out[-1].phase_steps  # what the re-split needs
    begin, _ = replan(d, out[-1])
    assert begin.continued and {s.micro_batches for s in begin.steps} == {(2, 2)}
    # room for more than runs: nothing re-planned, and the cap stays for later phases
    d = Driver()
    _, submit = d.start()
    out = finish_measured(d, submit, measured(1000.0, 4, 10_000.0))
    assert len(of(cmd.SubmitWindows, out)) == 1 and d.state.memory_cap == 32


def test_the_measured_cap_is_the_tightest_replicas():
    roomy = result(0, *_one_window())
    results = [
        dataclasses.replace(roomy, memory=measured(1000.0, 4, 10_000.0)),  # 32 samples
        dataclasses.replace(roomy, memory=measured(1000.0, 4, 2_000.0)),  # 6 samples
        roomy,  # a CPU replica measures nothing
    ]
    assert measured_cap(results) == 6
    assert measured_cap([roomy]) is None


def _one_window():
    d = Driver()
    _, submit = d.start()
    return submit.plan, submit.plan.windows[0]


class FakeCuda:
    """torch.cuda's memory counters, scripted."""

    def __init__(self) -> None:
        self.allocated, self.peak = 100, 0

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def memory_reserved(self, device):
        return 400

    def mem_get_info(self, device):
        return 1_000, 2_000


def test_the_memory_probe_measures_the_peak_above_what_stays_allocated():
    cuda = FakeCuda()
    probe = MemoryProbe(torch.device("cuda"), cuda=cuda)
    cuda.peak, cuda.allocated = 900, 200  # the window's forward and backward; gradients
    memory = probe.finish(samples=8)
    assert memory == {"peak_bytes": 700.0, "samples": 8.0, "usable_bytes": 1_200.0}
    assert measured_cap([type("R", (), {"memory": memory})()]) == 10  # 0.8 x 1200 / 87.5


class RunsOutAbove(TinyCNN):
    """TinyCNN whose forward raises torch's out-of-memory error when its input holds more
    than ``limit`` samples: a device that holds ``limit`` samples, deterministically."""

    limit = 6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {x.shape[0]} samples (test model)"
            )
        return super().forward(x)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fit_that_runs_out_of_memory_recovers_with_exact_accumulated_steps(client, tmp_path):
    """Then resumed from its checkpoint, it keeps the cap it learned: the next phase
    runs as micro-batches at once, without running out of memory again."""
    x, y = make_data(96)
    # Phase 0: 8 samples (4 per replica) fit; phase 1: 32 (16 each) run out twice (16,
    # then 8) and go on with micro-batches of 4 from the commit; phase 2 (resumed)
    # starts there.
    schedule = dfl.schedule.Stepwise({0: 8, 1: 32, 2: 64}, lr_scaling="none")
    pipe = tiny_pipeline(x, y, model=RunsOutAbove, schedule=schedule, replicas=2)
    first = pipe.fit(epochs=2, client=client, checkpoint_dir=tmp_path)
    failures = first.history.info["failures"]
    assert [f["reason"] for f in failures] == ["out-of-memory"] * 2
    assert [(f["phase"], f["micro_batch"], f["micro_batch_cap"]) for f in failures] == [
        (1, 16, 8),
        (1, 8, 4),
    ]
    assert first.history.info["micro_batch_cap"] == 4
    phase1_start = 96 // 8
    assert all(f["commit_step"] == phase1_start for f in failures)  # rolled back there
    result = pipe.fit(epochs=3, client=client, checkpoint_dir=tmp_path, resume=True)
    assert not result.history.info.get("failures"), "the resumed fit kept the cap"
    assert result.history.info["micro_batch_cap"] == 4
    for phase in result.history.phases:
        held = [
            -(-b // m) for b, m in zip(phase["local_batches"], phase["micro_batches"], strict=True)
        ]
        assert max(held) <= RunsOutAbove.limit, phase
    assert [p["micro_batches"] for p in result.history.phases] == [[1, 1], [4, 4], [8, 8]]
    batches = pipe.sample_plan(epochs=3, replicas=2)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-5
    for epoch in range(3):
        assert result.ledger.consumed(epoch).tolist() == list(range(96))
    steps = [s["step"] for s in result.history.steps]
    assert steps == list(range(len(steps))), "each step committed once, in order"
