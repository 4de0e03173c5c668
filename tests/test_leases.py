"""Sample leases (``dataflow/runtime/leases.py``): the parts of a window's batches,
claimed by compare-and-set on a real TCPStore from concurrent threads. Every part is
trained exactly once, whatever the speeds; a fast replica takes over a slow one's."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch.distributed as dist

from dataflow.runtime.leases import WindowLeases, planned_tasks


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)


def run_window(
    store, key: str, speeds: list[float], first: int = 0, stop: int = 25, held: int | None = None
) -> dict:
    """Each replica in its own thread with its own connection, sleeping up to
    ``speed`` ms per part (random interleavings, not an order): what each trained, in
    order. ``held``: a replica that takes its first part before the others start, then
    waits until every other replica is out of parts (a slow one, whatever the
    machine's speed)."""
    got: dict[int, list] = {}
    started, done = threading.Event(), {rank: threading.Event() for rank in range(len(speeds))}
    errors: list[BaseException] = []

    def replica(rank: int, speed: float) -> None:
        try:
            mine = dist.TCPStore("127.0.0.1", store.port, 1, False)
            board = WindowLeases(mine, key, first=first, stop=stop, replicas=len(speeds), rank=rank)
            got[rank] = []
            if held is not None and rank != held:
                assert started.wait(60), f"replica {held} never took its first part"
            for task in board.tasks():
                got[rank].append(task)
                if rank == held and len(got[rank]) == 1:
                    started.set()
                    for other, finished in done.items():
                        assert other == rank or finished.wait(60), f"replica {other} stuck"
                time.sleep(speed * random.random() / 1000)
        except BaseException as error:
            errors.append(error)
        finally:
            done[rank].set()

    threads = [threading.Thread(target=replica, args=r) for r in enumerate(speeds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return got


@pytest.mark.parametrize("speeds", [[0.1, 0.1, 0.1, 0.1, 3.0], [1.0, 1.0], [0.0, 0.0, 0.0]])
def test_every_part_is_trained_exactly_once(store, speeds):
    """Four fast thieves racing for one slow replica's parts (the race that once gave
    two thieves the same part), two equal replicas, and no delays at all."""
    replicas = len(speeds)
    for trial in range(4):
        got = run_window(store, f"once/{replicas}/{speeds[-1]}/{trial}", speeds, 10, 35)
        parts = [(step, rank if part is None else part) for rank, tasks in got.items()
                 for step, part in tasks]  # fmt: skip
        assert sorted(parts) == [(s, r) for s in range(10, 35) for r in range(replicas)]
        for rank, tasks in got.items():  # its own part of the last step, last
            assert tasks[-1] == (34, None), (rank, tasks[-3:])
            own = [step for step, part in tasks if part is None]
            assert own == sorted(own)  # its own parts from the front, in order


def test_a_fast_replica_takes_over_a_slow_ones_parts(store):
    """Replica 1 held after its first part until replica 0 ran out: replica 0 trains
    its own 20 parts, then takes over the 19 replica 1 had left, from the back, and its
    part of the last step; replica 1 trains its first part and its part of the last."""
    got = run_window(store, "fast", [0.0, 0.0], 0, 21, held=1)
    fast, slow = got[0], got[1]
    own = [(step, None) for step in range(20)]
    assert fast == own + [(step, 1) for step in range(19, 0, -1)] + [(20, None)], fast
    assert slow == [(0, None), (20, None)], slow


def test_a_one_step_window_and_no_leases():
    assert list(planned_tasks(3, 6)) == [(3, None), (4, None), (5, None)]
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    board = WindowLeases(store, "single", first=7, stop=8, replicas=2, rank=1)
    assert list(board.tasks()) == [(7, None)]  # the last step is never handed out


def test_a_replica_lost_after_a_leased_window_gets_what_the_others_did_not_train():
    """The driver never got its result: under leases which parts it trained is unknown,
    but every part was trained once, so its samples per step are the global batch less
    the others' (the others took over some of its parts here)."""
    from dataflow.core.step import StepSpec
    from dataflow.core.window import WindowResult
    from dataflow.driver.salvage import salvage_leased

    specs = tuple(
        StepSpec(index=i, epoch=0, step_in_epoch=i, start=24 * i, global_batch=24,
                 local_batches=(8, 8, 8), last_in_epoch=False)
        for i in range(3)
    )  # fmt: skip

    def result(rank, samples, taken=()):
        return WindowResult(rank=rank, first_step=0, samples=samples, losses=[None] * 3,
                            step_seconds=[0.0] * 3, stage_seconds={}, task_seconds=0.0,
                            taken_over=list(taken))  # fmt: skip

    filled = [result(0, [16, 8, 8], [(0, 2)]), result(1, [8, 8, 8]), result(2, [8, 8, 8])]
    salvage_leased(filled, [2], specs)
    assert filled[2].samples == [0, 8, 8]  # its part of step 0 was replica 0's


def test_a_lost_replica_that_took_over_a_survivors_part_passes_the_sample_check():
    """Found in a loaded CI run: replica 2 took over replica 0's part of a step, then was
    killed before the driver collected that window. The survivors' results name no
    takeover, yet replica 0 trained less than planned; the driver must not read that as
    lost data (it knows from the sync policy that parts move), and the lost replica's
    samples are what the others did not train."""
    from types import SimpleNamespace

    import numpy as np

    import dataflow as dfl
    from dataflow import stages
    from dataflow.core.digest import sample_digest
    from dataflow.core.step import StepSpec
    from dataflow.core.window import WindowResult
    from dataflow.driver.recorder import Recorder

    x, y = np.zeros((72, 2), np.float32), np.zeros(72, np.int64)
    load = stages.Load(dfl.io.ArraySource(x, y))
    specs = tuple(
        StepSpec(index=i, epoch=0, step_in_epoch=i, start=24 * i, global_batch=24,
                 local_batches=(8, 8, 8), last_in_epoch=i == 2)
        for i in range(3)
    )  # fmt: skip
    parts = [p for _, p in load.streams(specs, 0)]  # per step, per replica: indices

    def survivor(rank, steps):
        trained = np.concatenate([parts[i][rank] for i in steps])
        return WindowResult(rank=rank, first_step=0,
                            samples=[8 if i in steps else 0 for i in range(3)],
                            losses=[1.0 if i in steps else None for i in range(3)],
                            step_seconds=[0.01] * 3, stage_seconds={}, task_seconds=0.0,
                            sample_digest=sample_digest(trained))  # fmt: skip

    def recorder(leases):
        return Recorder(graph=None, order=(), load=load, seed=0, skips_non_finite=False,
                        progress=False, leases=leases)  # fmt: skip

    plan = SimpleNamespace(steps=specs, phase=SimpleNamespace(index=0))
    window = SimpleNamespace(first=0, stop=3)
    results = (survivor(0, [1, 2]), survivor(1, [0, 1, 2]), None)  # 2 trained 0's step 0
    leased = recorder(leases=True)
    assert leased.commit_window(plan, window, results, specs) is None
    assert [s.samples for s in leased.history.steps] == [24, 24, 24]
    assert leased.ledger.summary()[0]["consumed"] == 72
    refused = recorder(leases=False).commit_window(plan, window, results, specs)  # no leases
    assert isinstance(refused, dfl.errors.DataError)  # for the machine to decide on
    assert "replica 0 read other samples" in str(refused)
