"""A window's commit: the state copied to host memory without a sync per tensor
(HostCopies), rolled back to exactly. On the CPU the copies are made at once; the
CUDA path (enqueued into page-locked memory, no host sync) runs in tests/test_gpu.py
through the same ``commit_then_train_then_roll_back``."""

import contextlib
import dataclasses
import threading
import time

import torch
from conftest import in_process, make_data, tiny_pipeline

from dataflow.runtime import host_copies
from dataflow.runtime.host_copies import HostArena, HostCopies, host_copy
from dataflow.runtime.replica import ReplicaRuntime
from dataflow.runtime.replica_spec import ReplicaState


def _replica(device: str) -> ReplicaRuntime:
    """One replica of a TinyCNN pipeline on ``device``, in this process, its phase begun,
    committing only when told to (the test commits by hand)."""
    x, y = make_data(64)
    options = dict(device=device, precision="fp32", channels_last=False)
    # prefetch 8: the loader reads the phase's 4 steps at once, then stops
    pipe = tiny_pipeline(x, y, prefetch=8, **options)
    runtime, _ = in_process(pipe.trainer, epochs=1, device=device, commit_windows=False)
    return runtime


def _host_state(runtime: ReplicaRuntime) -> tuple[dict, list]:
    """Weights and momentum buffers, copied the plain (blocking) way."""
    ctx = runtime.context
    weights = {k: v.detach().cpu().clone() for k, v in ctx.model.state_dict().items()}
    momenta = [
        ctx.optimizer.state[p]["momentum_buffer"].detach().cpu().clone()
        for p in ctx.model.parameters()
    ]
    return weights, momenta


def _loader_finished(timeout_s: float = 60.0) -> None:
    """Wait until no Load prefetch thread runs (each read its phase's every step)."""
    deadline = time.monotonic() + timeout_s
    while any(t.name == "dataflow-prefetch" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the loader thread did not finish its phase"
        time.sleep(0.01)


def commit_then_train_then_roll_back(device: str, during_commit=None) -> None:
    """Train 2 steps, commit at step 2 (``during_commit``: a context the commit runs
    in, e.g. torch's sync check), train 2 more steps, which change the weights while
    the commit's copies may still be running, then roll back to the commit: weights and
    momentum are those at step 2, bit for bit."""
    runtime = _replica(device)
    runtime.run_window(0, 2)
    want_weights, want_momenta = _host_state(runtime)
    if during_commit is None:
        runtime.commit(2)
    else:  # torch's sync check is process-wide: the loader's reads must be over first
        _loader_finished()
        with during_commit():
            runtime.commit(2)
    runtime.run_window(2, 4)
    moved, _ = _host_state(runtime)
    assert any(not torch.equal(moved[k], want_weights[k]) for k in want_weights)
    runtime.rollback(2)
    got_weights, got_momenta = _host_state(runtime)
    for name, value in want_weights.items():
        assert torch.equal(got_weights[name], value), name
    for got, want in zip(got_momenta, want_momenta, strict=True):
        assert torch.equal(got, want)


def test_a_rollback_restores_the_committed_weights_and_momentum_exactly():
    # (as the GPU test runs it: the commit after the loader's reads are over)
    commit_then_train_then_roll_back("cpu", during_commit=contextlib.nullcontext)


def test_cpu_tensors_are_copied_at_once_and_leave_nothing_pending():
    """Only a CUDA tensor's copy is enqueued; a CPU tensor's is made at once, so a
    state of them needs no settling and later changes do not reach it."""
    source = {"w": torch.ones(3), "m": [torch.zeros(2)], "step": 5}
    copies = HostCopies()
    copied = host_copy(source, copies)
    source["w"].add_(1)
    assert copies.done() is None
    assert torch.equal(copied["w"], torch.ones(3)) and copied["step"] == 5
    assert copied["m"][0] is not source["m"][0]


def test_a_settled_state_compares_and_pickles_without_its_event():
    """``pending`` is no part of the state's value: states compare by their tensors, and
    a settled one holds no event (what leaves the worker is always settled)."""
    state = ReplicaState(rng={"python": 1})
    assert state.settle().pending is None
    assert state == dataclasses.replace(state, pending=object())


def _mixed_tensors() -> dict[str, torch.Tensor]:
    """A state dict's kinds of tensor: weights in channels_last, a 0-d counter, an empty
    tensor, flags, float64 statistics."""
    return {
        "conv": torch.randn(8, 3, 5, 5).contiguous(memory_format=torch.channels_last),
        "count": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "mask": torch.rand(33) > 0.5,
        "stats": torch.randn(17, dtype=torch.float64),
    }


def test_an_arena_packs_a_state_apart_with_each_tensors_values_and_strides():
    source = _mixed_tensors()
    arena = HostArena(pinned=False)
    copied = host_copy(source, HostCopies(arena))
    for name, value in source.items():
        assert torch.equal(copied[name], value), name
        assert copied[name].stride() == value.stride() and copied[name].dtype == value.dtype
    copied["stats"].fill_(0)  # the copies share no bytes with each other
    assert all(torch.equal(copied[n], source[n]) for n in source if n != "stats")
    assert arena.nbytes == host_copies.SEGMENT_BYTES  # one segment held all of them


def test_a_reset_arena_reuses_its_buffers_and_a_large_tensor_gets_its_own(monkeypatch):
    """Reused, an arena takes no new memory for a state of the same sizes; a tensor over
    a segment has a buffer of its own, reused by the next commit's."""
    monkeypatch.setattr(host_copies, "SEGMENT_BYTES", 4096)
    arena = HostArena(pinned=False)
    state = {"big": torch.randn(3000), **_mixed_tensors()}  # 12 kB: over one segment
    first = host_copy(state, HostCopies(arena))
    held = arena.nbytes
    assert len(arena.large) == 1 and len(arena.large[0]) == 12000
    arena.reset()
    state = {k: v + 1 if v.dtype.is_floating_point else v for k, v in state.items()}
    second = host_copy(state, HostCopies(arena))
    assert arena.nbytes == held
    assert torch.equal(second["big"], state["big"]) and torch.equal(second["conv"], state["conv"])
    assert first["big"].data_ptr() == second["big"].data_ptr()  # the same buffer again


def test_commits_reuse_the_buffers_of_the_commits_they_drop():
    """A commit per window: the replica holds its two live commits' buffers and one
    spare, and after the first windows takes no new ones."""
    runtime = _replica("cpu")
    held = []
    for window in range(4):
        runtime.commit(window)
        runtime.run_window(window, window + 1)
        arenas = [*runtime.commit_arenas.values(), *runtime.spare_arenas]
        held.append(sum(a.nbytes for a in arenas))
        assert sorted(runtime.commits) == list(range(max(0, window - 1), window + 1))
        assert len(runtime.spare_arenas) <= 1
    assert held[2] == held[3]
    runtime.rollback(2)  # the older of the two live commits, still whole
    runtime.commit(2)  # committed again at the same step: its old buffers become spare
    assert sorted(runtime.commits) == [2, 3]
