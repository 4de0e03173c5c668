"""A replica slower than ``collective_timeout_s`` for a while (a store riding out
failures, a slow file system, a long pause) is not a lost worker: its peers' allreduce
(or, under ``Async`` and ``Local``, the parameter store's barrier) times out, the driver
finds every worker alive, and the phase's rest is redone from the last commit with the
group formed again, where the fit used to stop with the timeout.
A peer that does not end its step long after the timeout is hung, and is dropped as a
lost worker. A real LocalCluster, a real gloo timeout; the stall is a test stage that
sleeps once, past the timeout, on one replica."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from conftest import TinyCNN, make_data, sgd

import dataflow as dfl
from dataflow import stages

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0


class StallOnce(stages.Stage):
    """Test stage: at step ``step`` on replica ``rank``, sleeps ``seconds`` (once per
    ``marker`` file), before the step's allreduce; a file ``marker + ".release"`` ends
    the sleep early (a hang ended once its test has seen what it needs); then, with
    ``fail_on_release``, the step raises (the hang ends in an error, as a read that gave
    up would)."""

    def __init__(
        self, marker: str, *, step: int, rank: int, seconds: float, fail_on_release: bool = False
    ) -> None:
        super().__init__("StallOnce")
        self.marker, self.step, self.rank, self.seconds = marker, step, rank, seconds
        self.fail_on_release = fail_on_release

    def run(self, step: stages.StepContext, batch: stages.Batch) -> stages.Batch:
        replica = step.replica
        if (
            step.spec.index == self.step
            and replica.rank == self.rank
            and not os.path.exists(self.marker)
        ):
            with open(self.marker, "w") as f:
                f.write(str(time.time()))
            end = time.monotonic() + self.seconds
            while time.monotonic() < end and not os.path.exists(self.marker + ".release"):
                time.sleep(0.05)
            if self.fail_on_release:
                raise RuntimeError("the hang ended in an error")
        return batch


SYNC = {
    "sync": dfl.sync.Synchronous(),
    "async": dfl.sync.Async(),
    "local": dfl.sync.Local(period_steps=4),
}


def _trainer(
    source: Any,
    *,
    stall: stages.Stage | None = None,
    sync: str = "sync",
    schedule: Any = None,
) -> dfl.Trainer:
    """Two replicas of TinyCNN on ``source``, 4-step windows, the tests' short timeout;
    ``stall`` (a test stage) between Load and Forward."""
    g = dfl.Graph()
    batch = g.add(stages.Load(source))
    if stall is not None:
        batch = g.add(stall, batch)
    out = g.add(stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    g.add(stages.Update(sgd), g.add(stages.AllReduce(), g.add(stages.Backward(), out)))
    return dfl.Trainer(
        g,
        schedule=dfl.schedule.Fixed(24) if schedule is None else schedule,
        seed=0,
        progress=False,
        replicas=2,
        window_steps=4,
        collective_timeout_s=TIMEOUT_S,
        sync=SYNC[sync],
    )


def _stalled(marker, seconds: float = 2.5 * TIMEOUT_S, sync: str = "sync") -> dfl.Trainer:
    """Replica 1 sleeps ``seconds`` once, at step 5."""
    stall = StallOnce(str(marker), step=5, rank=1, seconds=seconds)
    return _trainer(dfl.io.ArraySource(*make_data(240)), stall=stall, sync=sync)


# (synchronous training's stall, and its weights, in the data-wait test below)
@pytest.mark.parametrize("sync", ["local", "async"])
def test_a_peer_slower_than_the_collective_timeout_is_waited_out_not_fatal(client, tmp_path, sync):
    marker = tmp_path / "stalled"
    result = _stalled(marker, sync=sync).fit(epochs=2, client=client)
    assert marker.exists()  # the stall happened
    [failure] = result.history.info["failures"]
    assert failure["reason"] == "stalled" and failure["lost"] == []
    assert failure["replicas_before"] == failure["replicas_after"] == 2
    assert failure["commit_step"] <= 5
    # what timed out: a barrier of the parameter store
    assert "waited 2 s for" in failure["error"]
    for epoch in range(2):
        assert result.ledger.summary()[epoch] == {"consumed": 240, "unused": 0}
    if sync == "async":  # the order pushes apply in is the replicas' race: not compared
        return
    # redone from the commit, the same steps on the same replicas: the uninterrupted fit
    reference = _stalled(marker, sync=sync).fit(epochs=2, client=client)  # (no stall now)
    assert not reference.history.info.get("failures")
    want = reference.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in result.model.state_dict().items())


class StuckOnce(dfl.io.ArraySource):
    """Test source: one worker's ``after``-th read blocks (once, whichever worker gets
    there first) until ``marker + ".release"`` appears: a store outage the reader rides
    out for minutes, on one replica only."""

    def __init__(self, x, y, marker: str, after: int) -> None:
        super().__init__(x, y)
        self.marker, self.after, self.reads = marker, after, 0
        self.driver = os.getpid()

    def read(self, indices):
        if os.getpid() == self.driver:  # the driver's dry run
            return super().read(indices)
        self.reads += 1
        if self.reads == self.after:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return super().read(indices)
            while not os.path.exists(self.marker + ".release"):
                time.sleep(0.05)
        return super().read(indices)


def test_a_replica_waiting_minutes_for_its_data_is_not_hung_the_phase_is_redone(tmp_path):
    """One replica's batch does not come (its read blocks far past the timeout, as a
    store riding out an outage for ``retry_s``): the peer's allreduce times out, the
    driver aborts the round, the waiting Load leaves its wait, and the phase's rest is
    redone on both replicas, with the uninterrupted fit's weights. It used to sit in
    its wait until dropped as hung (its own cluster: the blocked read thread outlives
    the window until released)."""
    from dataflow.runtime.cluster import client_or_local_cluster

    x, y = make_data(240)
    marker = str(tmp_path / "stuck")

    def trainer() -> dfl.Trainer:
        return _trainer(StuckOnce(x, y, marker, after=6))

    with client_or_local_cluster(None, n_workers=2, announce=False) as client:
        try:
            result = trainer().fit(epochs=2, client=client)
        finally:
            (tmp_path / "stuck.release").touch()
        assert os.path.exists(marker)  # a read blocked
        [failure] = result.history.info["failures"]
        assert failure["reason"] == "stalled" and failure["lost"] == [], failure
        assert "Timed out" in failure["error"]  # the peer's allreduce
        assert len(failure["slow_replicas"]) == 1  # the reader, still in its step
        assert failure["replicas_before"] == failure["replicas_after"] == 2
        for epoch in range(2):
            assert result.ledger.summary()[epoch] == {"consumed": 240, "unused": 0}
        reference = trainer().fit(epochs=2, client=client)  # (the marker: nothing blocks)
    assert not reference.history.info.get("failures")
    want = reference.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in result.model.state_dict().items())


# Local stands for Async too: both let the survivors finish a window without a lost
# replica (a release), which a hang's drop must not ask of them (their window failed)
@pytest.mark.parametrize("sync", ["sync", "local"])
def test_a_hung_peer_is_dropped_and_back_idle_rejoins_at_the_next_phase(
    tmp_path, sync, monkeypatch
):
    """Replica 1 is still in its step once the driver has waited the failure grace and
    another timeout: it counts as lost, and the other replica goes on alone while the
    hang lasts (its own cluster: the hung worker is excluded from it). Once the fit has
    finished epoch 0 without it, the hang ends (in an error, at once). At the next
    phase's choice the driver finds the worker idle and takes it again: the later phases
    train on 2 replicas, where it used to stay out for the rest of the fit. Every sample
    of every epoch is trained once. Under Local the drop used to end the fit with "no
    event to wait for": the survivor was asked to finish a window that had failed."""
    from dataflow.driver import executor, window_watch
    from dataflow.runtime.cluster import client_or_local_cluster

    for module in (executor, window_watch):  # nobody dies here: no scheduler word to await
        monkeypatch.setattr(module, "FAILURE_GRACE_S", 1.0)

    marker = tmp_path / "hung"
    release = tmp_path / "hung.release"
    stall = StallOnce(str(marker), step=5, rank=1, seconds=120.0, fail_on_release=True)
    schedule = dfl.schedule.Stepwise({0: 24, 2: 48, 4: 80}, lr_scaling="none")
    source = dfl.io.ArraySource(*make_data(240))
    trainer = _trainer(source, stall=stall, schedule=schedule, sync=sync)

    def end_the_hang(epoch, history):
        if epoch["epoch"] == 0:  # the hung replica was dropped before this epoch ended
            assert history.info["failures"][0]["reason"] == "lost workers"
            release.touch()

    with client_or_local_cluster(None, n_workers=2, announce=False) as client:
        try:
            result = trainer.fit(epochs=6, client=client, on_epoch=end_the_hang)
        finally:
            release.touch()
    [failure] = result.history.info["failures"]
    assert failure["reason"] == "lost workers" and len(failure["lost"]) == 1
    assert failure["replicas_before"] == 2 and failure["replicas_after"] == 1
    [readmitted] = result.history.info["readmitted"]
    assert readmitted["workers"] == failure["lost"]
    assert readmitted["epoch"] in (2, 4)  # the first phase choice that found it idle
    replicas = {p["start_epoch"]: p["replicas"] for p in result.history.phases}
    assert replicas[4] == 2 and replicas[readmitted["epoch"]] == 2
    summary = result.summary()  # what a user reads: the drop, and the return
    assert "recovered from 1 failure(s): lost workers (on from step" in summary, summary
    assert f"{failure['lost'][0]} taken back from epoch {readmitted['epoch']}" in summary
    for epoch in range(6):
        assert result.ledger.summary()[epoch] == {"consumed": 240, "unused": 0}
