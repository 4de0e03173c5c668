"""The executor reading finished windows' results when a worker has just died.

A real LocalCluster with worker processes and a real SIGKILL: the dead worker's
finished results cannot be read, and the executor must not wait on each of them
(``Future.result(timeout)`` waits its whole timeout per future there: the client resets
a future it could not read and waits for a recomputation pinned to the dead worker).
What is asserted is what the executor called and queued, never how long it took.
"""

from __future__ import annotations

import itertools
import os
import signal
from types import SimpleNamespace

import pytest
from distributed import Client, Future, LocalCluster, wait

from dataflow.core.window import WindowResult
from dataflow.driver import events as ev
from dataflow.driver.executor import Executor
from dataflow.driver.membership import LIVENESS_POLL_S, ResultReader

pytestmark = pytest.mark.slow  # real worker processes, one really killed


def window_result(rank: int, first_step: int) -> WindowResult:
    """What a replica's window task returns (runs on the worker)."""
    return WindowResult(
        rank=rank,
        first_step=first_step,
        samples=[4],
        losses=[1.0],
        step_seconds=[0.1],
        stage_seconds={},
        task_seconds=0.1,
    )


@pytest.mark.timeout(120)
def test_results_on_a_just_killed_worker_are_not_waited_for(monkeypatch):
    """Windows 0 and 1 finished on both replicas; replica 1's worker is SIGKILLed before
    the driver read them. The harvest reads replica 0's results and queues them, and
    attempts no read of the dead worker's (the old code read each with a 1 s timeout);
    the loss is queued right after what the survivor finished."""
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        survivor, victim = sorted(client.scheduler_info()["workers"])
        pid = client.run(os.getpid, workers=[victim])[victim]
        spec = SimpleNamespace(run_id="reads", layout=None, collective_timeout_s=10.0)
        executor = Executor(client, spec)
        executor.members = (survivor, victim)
        held_by: dict[str, str] = {}
        for window in range(2):
            for rank, worker in enumerate(executor.members):
                future = client.submit(
                    window_result,
                    rank,
                    window,
                    workers=[worker],
                    allow_other_workers=False,
                    pure=False,
                )
                executor.windows[future] = (0, rank, window)
                executor.slot_of[future] = rank
                held_by[future.key] = worker
        wait(list(executor.windows))
        reads: list[str] = []
        result = Future.result

        def counted(self, *args, **kwargs):
            reads.append(held_by.get(self.key, "other"))
            return result(self, *args, **kwargs)

        monkeypatch.setattr(Future, "result", counted)
        os.kill(pid, signal.SIGKILL)
        executor._harvest()  # a poll's: what finished, before the loss is known
        executor.queue_lost([victim])  # (the loss the poll then hears of)
        events = list(executor.queue)
        executor.close(failed=False)

    assert victim not in reads, reads
    done = [e for e in events if isinstance(e, ev.WindowDone)]
    assert [(e.window, sorted(e.results)) for e in done] == [(0, [0]), (1, [0])]
    assert isinstance(events[-1], ev.WorkersLost) and events[-1].workers == (victim,)


def large_result() -> bytes:
    """A result that takes longer than a microsecond to move (runs on the worker)."""
    return bytes(64 * 2**20)


@pytest.mark.timeout(120)
def test_a_result_slower_to_move_than_the_read_timeout_is_read_with_a_longer_one(client):
    """A result (a large checkpoint, say) that cannot move within the read's timeout is
    not asked for again with the same timeout forever: each read that times out doubles
    it, and the result arrives; the next read starts from the short timeout again."""
    future = client.submit(large_result, pure=False)
    wait([future])
    reader = ResultReader(client, longest_s=30.0)
    reader.timeout_s = 1e-6  # shorter than any gather
    timeouts, read = [], {}
    while not read:
        timeouts.append(reader.timeout_s)
        read = reader.read([future])
    assert len(read[future.key]) == 64 * 2**20
    assert len(timeouts) > 1 and all(b == 2 * a for a, b in itertools.pairwise(timeouts))
    assert reader.timeout_s == LIVENESS_POLL_S
