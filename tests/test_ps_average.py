"""Local updates' average at the parameter store (``dataflow/ps/average.py``), driven
directly on an event loop: the barrier, the weights, a lost replica's retrain round."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dataflow.ps.average import AverageShard, HandedIn
from dataflow.ps.shard import ShardError

# A window of steps 10-11, three replicas, each with a part of each step
PLANNED = [(step, owner) for step in (10, 11) for owner in range(3)]


def handed(replica: int, value: float, *, samples: int = 8, parts=None, bad=None) -> HandedIn:
    """Replica ``replica``'s state: 4 parameters and 2 other elements, all ``value``."""
    own = {(step, replica) for step in (10, 11)} if parts is None else set(parts)
    return HandedIn(
        parts=frozenset(own),
        samples=samples,
        state=torch.full((6,), float(value), dtype=torch.float64),
        parameters=4,
        first_bad=bad,
    )


def shard(replicas: int = 3, timeout_s: float = 10.0) -> AverageShard:
    return AverageShard(window=10, incarnation=0, replicas=replicas, timeout_s=timeout_s)


def run(coroutine):
    return asyncio.run(coroutine)


async def until(condition, what: str) -> None:
    """Yield to the event loop until ``condition()`` holds: the hand-ins under test run on
    this loop, so they get there in a few turns, whatever the machine's speed."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


def test_the_average_waits_for_every_replica_and_weights_by_samples():
    async def main():
        s = shard()
        calls = [
            s.average(0, 10, 12, 0, PLANNED, handed(0, 1.0, samples=8)),
            s.average(1, 10, 12, 0, PLANNED, handed(1, 2.0, samples=8)),
            s.average(2, 10, 12, 0, PLANNED, handed(2, 4.0, samples=16)),
        ]
        replies = await asyncio.gather(*calls)
        return s, replies

    s, replies = run(main())
    expected = (8 * 1.0 + 8 * 2.0 + 16 * 4.0) / 32
    for reply in replies:
        assert torch.equal(reply["average"], torch.full((6,), expected, dtype=torch.float64))
        assert reply["dropped"] == [] and reply["first_bad"] == {}
        assert reply["contributors"] == [0, 1, 2]
    # drift: sum_r w_r |θ_r - θ̄|² / |θ̄|² over the 4 parameters
    spread = sum(w * 4 * (v - expected) ** 2 for w, v in ((0.25, 1.0), (0.25, 2.0), (0.5, 4.0)))
    assert replies[0]["drift"] == pytest.approx(spread / (4 * expected**2))
    assert s.window == 12 and s.round == 0  # it serves the next window


def test_a_replica_lost_before_it_handed_in_has_its_parts_retrained_by_the_survivors():
    async def main():
        s = shard()
        first = [
            asyncio.ensure_future(s.average(r, 10, 12, 0, PLANNED, handed(r, float(r + 1))))
            for r in (0, 1)
        ]
        await until(lambda: s.this_round == {0, 1}, "replicas 0 and 1 handed in")
        assert not any(f.done() for f in first)  # replica 2 is still training
        await s.drop([2])
        retrain = await asyncio.gather(*first)
        # the survivors train replica 2's parts (the runtime shares them out) and hand
        # in again, their new parts and samples with them
        parts0 = {(10, 0), (11, 0), (10, 2)}
        parts1 = {(10, 1), (11, 1), (11, 2)}
        final = await asyncio.gather(
            s.average(0, 10, 12, 1, PLANNED, handed(0, 3.0, samples=12, parts=parts0)),
            s.average(1, 10, 12, 1, PLANNED, handed(1, 5.0, samples=12, parts=parts1)),
        )
        return retrain, final

    retrain, final = run(main())
    for reply in retrain:
        assert reply["retrain"] == [(10, 2), (11, 2)] and reply["dropped"] == [2]
    for reply in final:
        assert torch.equal(reply["average"], torch.full((6,), 4.0, dtype=torch.float64))
        assert reply["contributors"] == [0, 1] and reply["dropped"] == [2]


def test_a_state_handed_in_before_the_loss_still_counts_and_nothing_is_retrained():
    async def main():
        s = shard()
        early = asyncio.ensure_future(s.average(2, 10, 12, 0, PLANNED, handed(2, 4.0)))
        await until(lambda: 2 in s.this_round, "replica 2 handed in")
        await s.drop([2])  # its worker died after it handed in
        rest = await asyncio.gather(
            s.average(0, 10, 12, 0, PLANNED, handed(0, 1.0)),
            s.average(1, 10, 12, 0, PLANNED, handed(1, 1.0)),
        )
        return early, rest

    early, rest = run(main())
    for reply in rest:
        assert "retrain" not in reply
        assert torch.equal(reply["average"], torch.full((6,), 2.0, dtype=torch.float64))
        assert reply["contributors"] == [0, 1, 2]
    assert early.done()


def test_every_replicas_first_bad_step_comes_back_with_the_average():
    async def main():
        s = shard(replicas=2)
        planned = [(step, owner) for step in (10, 11) for owner in range(2)]
        return await asyncio.gather(
            s.average(0, 10, 12, 0, planned, handed(0, 1.0)),
            s.average(1, 10, 12, 0, planned, handed(1, 1.0, bad=11)),
        )

    for reply in run(main()):
        assert reply["first_bad"] == {1: 11}


def test_a_hand_in_for_the_wrong_round_or_after_the_drop_is_refused():
    async def main():
        s = shard()
        await s.drop([2])
        with pytest.raises(ShardError, match="dropped as lost"):
            await s.average(2, 10, 12, 0, PLANNED, handed(2, 1.0))
        with pytest.raises(ShardError, match="round 1 of window 10"):
            await s.average(0, 10, 12, 1, PLANNED, handed(0, 1.0))

    run(main())


def test_a_replica_that_never_hands_in_times_the_barrier_out_with_its_rank():
    async def main():
        s = shard(replicas=2, timeout_s=0.05)
        await s.average(0, 10, 12, 0, PLANNED, handed(0, 1.0))

    with pytest.raises(ShardError, match=r"waited 0.05 s for replicas \[1\]"):
        run(main())


def test_a_failed_shard_fails_the_waiting_hand_ins():
    async def main():
        s = shard(replicas=2)
        waiting = asyncio.ensure_future(s.average(0, 10, 12, 0, PLANNED, handed(0, 1.0)))
        await until(lambda: 0 in s.this_round, "replica 0 handed in")
        assert not waiting.done()  # it waits for replica 1
        await s.fail("replica 1 failed in window 10")
        await waiting

    with pytest.raises(ShardError, match="replica 1 failed"):
        run(main())


def test_the_held_out_sums_wait_for_every_replica_and_keep_a_lost_ones_share():
    """The evaluation at a window's end: each replica hands in its held-out sums and
    gets every replica's back. Replica 1 handed in and then died: its share stays
    (its own result may never reach the driver). Replica 2 died before it handed in:
    once dropped, nobody waits for it and its share is missing (the survivors score it)."""

    def sums(rank):
        return {"count": 10.0, "loss": float(rank)}

    async def main():
        s = shard()
        calls = [asyncio.ensure_future(s.sum_held_out(r, 11, sums(r))) for r in (0, 1)]
        await until(lambda: set(s.held_out.get(11, ())) == {0, 1}, "replicas 0, 1 handed in")
        assert not any(c.done() for c in calls)  # replica 2 is still evaluating
        await s.drop([1, 2])
        replies = await asyncio.gather(*calls)
        with pytest.raises(ShardError, match="replica 2 handed in scores after it was dropped"):
            await s.sum_held_out(2, 11, sums(2))
        return replies

    for reply in run(main()):
        assert reply["sums"] == {0: sums(0), 1: sums(1)}


def test_held_out_sums_that_never_all_arrive_time_out_naming_the_missing_replica():
    async def main():
        s = shard(replicas=2, timeout_s=0.2)
        with pytest.raises(ShardError, match=r"evaluation at step 11 .* replicas \[1\]"):
            await s.sum_held_out(0, 11, {"count": 5.0})

    run(main())


def test_every_barrier_that_waited_past_the_timeout_reads_as_a_slow_peer_to_the_driver():
    """A replica slower than ``collective_timeout_s`` under ``Async`` or ``Local`` times
    out the store's barriers on its peers. The driver redoes the phase from the commit
    when every worker is alive (``is_wait_timeout``), as for a collective's timeout: the
    real messages of each barrier, as a replica raises them, are recognised; a peer's
    failure echoed by the store, a refused call and a closed connection are not."""
    from test_async_updates import _shard

    from dataflow.driver.root_cause import is_wait_timeout
    from dataflow.ps.plane import PlaneError

    async def timed_out(call) -> str:
        with pytest.raises(ShardError) as caught:
            await call
        return str(caught.value)

    async def main():
        return [
            await timed_out(shard(2, 0.05).average(0, 10, 12, 0, PLANNED, handed(0, 1.0))),
            await timed_out(shard(2, 0.05).sum_held_out(0, 11, {"count": 5.0})),
            await timed_out(_shard(2, window=10, timeout_s=0.05).finish(0, 10, 12)),
        ]

    messages = run(main())
    assert len(set(messages)) == 3
    for message in messages:  # as the replica's client raises it
        assert is_wait_timeout(ShardError(f"parameter store, replica 0: {message}"))
    assert is_wait_timeout(PlaneError("parameter-store host 10.0.0.1:4000: timed out"))
    for other in (
        ShardError("parameter store, replica 0: replica 1 failed in window 10: bad chunk"),
        ShardError("parameter store, replica 0: replica 1 pushed after it was dropped as lost"),
        PlaneError("the peer closed the connection"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (waited 2 s for nothing)"),
    ):
        assert not is_wait_timeout(other), other
