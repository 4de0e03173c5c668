"""Each worker that sees several GPUs trains on one of its own, held for the process's
life (``runtime/gpu_claim.py``): real ``flock`` locks, real processes, a real SIGKILL.

The GPUs are named, not used: a claim is a lock on a file named for a GPU's UUID, so
the mechanism runs the same on a machine without one. What rides on it on a GPU node:
no two replicas on one GPU after a regroup (NCCL refuses that, and the group fell back
to gloo through host memory), and dask-cuda's rotated device lists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dataflow.runtime.cluster import embedded_worker_count
from dataflow.runtime.gpu_claim import LOCK_DIR_ENV, choose_gpu, claim_gpu, free_slot

GPUS = ["GPU-aaaa", "GPU-bbbb"]


def test_a_claim_takes_the_least_held_gpu_first_in_the_process_order():
    assert choose_gpu([0, 0, 0]) == 0
    assert choose_gpu([1, 0, 1]) == 1
    assert choose_gpu([2, 1, 1]) == 1
    assert free_slot(set()) == 0
    assert free_slot({0, 2}) == 1
    assert free_slot({0, 1}) == 2


def test_workers_on_one_host_take_distinct_gpus_then_share_them_evenly(tmp_path):
    claims = [claim_gpu(GPUS, tmp_path) for _ in range(5)]
    assert [(c.index, c.sharers) for c in claims] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    claims[1].release()  # GPU b now has one holder, a three
    again = claim_gpu(GPUS, tmp_path)
    assert (again.index, again.sharers) == (1, 1)
    for claim in [*claims, again]:
        claim.release()


def test_processes_that_order_the_gpus_differently_still_take_distinct_ones(tmp_path):
    """dask-cuda shows worker k every GPU with its own first (CUDA_VISIBLE_DEVICES
    rotated by k): each takes its index 0, and those are different GPUs."""
    first = claim_gpu(GPUS, tmp_path)
    rotated = claim_gpu(GPUS[::-1], tmp_path)
    assert (first.index, rotated.index) == (0, 0)  # GPU a, then GPU b
    third = claim_gpu(GPUS[::-1], tmp_path)
    assert (third.index, third.sharers) == (0, 1)  # both held once: its own first
    for claim in (first, rotated, third):
        claim.release()


CLAIMER = """
import sys, time
from pathlib import Path
from dataflow.runtime.gpu_claim import claim_gpu
claim = claim_gpu(sys.argv[2:], Path(sys.argv[1]))
print(claim.index, claim.sharers, flush=True)
time.sleep(600)
"""


def test_a_killed_workers_gpu_goes_to_the_next_claim(tmp_path):
    """The kernel drops a dead process's lock: the worker a nanny starts in its place
    takes the GPU it held, not the rank's."""
    holder = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, str(tmp_path), *GPUS], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().split() == ["0", "0"]
        mine = claim_gpu(GPUS, tmp_path)
        assert (mine.index, mine.sharers) == (1, 0)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    replacement = claim_gpu(GPUS, tmp_path)
    assert (replacement.index, replacement.sharers) == (0, 0)
    mine.release()
    replacement.release()


def test_no_claim_where_no_lock_can_be_taken(tmp_path):
    """A lock directory that cannot be made: no claim (the caller keeps the rank rule),
    never an error that stops a fit."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert claim_gpu(GPUS, blocker / "locks") is None
    assert claim_gpu([], tmp_path) is None


def test_the_embedded_cluster_starts_one_worker_per_gpu():
    assert embedded_worker_count("auto", cores=16, gpus=4) == 4
    assert embedded_worker_count("cuda", cores=16, gpus=8) == 8
    assert embedded_worker_count("cuda:1", cores=16, gpus=4) == 1
    assert embedded_worker_count("auto", cores=16, gpus=1, needed=2) == 2  # replicas=2
    assert embedded_worker_count("cpu", cores=16, gpus=4) == 16
    assert embedded_worker_count("auto", cores=2, gpus=0) == 2


@pytest.mark.slow
def test_a_restarted_worker_takes_the_gpu_its_predecessor_held(tmp_path, monkeypatch):
    """Two nanny-managed worker processes claim distinct GPUs through the worker
    plugin; one is SIGKILLed, and the worker the nanny starts in its place claims the
    GPU the dead one held (the rank rule gave a joiner the GPU of a survivor whose rank
    had moved)."""
    from conftest import nanny_cluster

    from dataflow.runtime.plugin import plugin_of

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path))  # the spawned workers inherit it

    def claimed(dask_worker):
        claim = plugin_of(dask_worker).gpu.get(GPUS)
        return claim.index, claim.sharers, os.getpid()

    with nanny_cluster(2) as client:
        client.wait_for_workers(2)
        before = client.run(claimed)
        assert sorted((i, s) for i, s, _ in before.values()) == [(0, 0), (1, 0)]
        victim = next(a for a, (i, _, _) in before.items() if i == 1)
        os.kill(before[victim][2], signal.SIGKILL)
        deadline = time.monotonic() + 240
        while (
            victim in client.scheduler_info()["workers"]
            or len(client.scheduler_info()["workers"]) < 2
        ):
            assert time.monotonic() < deadline, "the nanny did not restart the worker"
            time.sleep(0.1)
        after = client.run(claimed)
        new = next(a for a in after if a not in before)
        assert after[new][:2] == (1, 0)  # the freed GPU, alone
        survivor = next(a for a in after if a in before)
        assert after[survivor][:2] == before[survivor][:2]  # kept its own
