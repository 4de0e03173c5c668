"""A worker process killed with SIGKILL in the middle of a window: the fit goes on.

Real LocalClusters with nannies (which restart a killed worker under a new address)
and real process groups. The survivors roll back to the last window every replica
finished, the phase's remaining steps are split over them, and the restarted worker
joins at the next phase. Every sample is still trained on once per epoch.
"""

import itertools
import json
import math
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    TinyCNN,
    WitnessPairs,
    learnable_labels,
    make_data,
    max_abs_diff,
    noise_pairs_fed,
    reference_training,
    sgd,
)
from distributed import Client, LocalCluster
from test_driver_replay import assert_log_replays

import dataflow as dfl
from dataflow import stages
from dataflow.checkpoint import CheckpointStore, ledger_from_state
from dataflow.planning.plan import resplit_steps
from dataflow.schedule.balance import Even
from dataflow.schedule.noise_scale import adascale_gain

pytestmark = pytest.mark.slow  # real worker processes, really killed

N_SAMPLES = 480


class KillOnce(stages.Stage):
    """Test stage: SIGKILLs its own worker process at step ``step`` on replica ``rank``
    (None: on every replica, each with its own marker ``marker.<rank>``), once per
    ``marker`` file (written first, with the time of the kill). ``or_later``: at the
    first step from ``step`` on that the replica runs (under sample leases a faster
    replica may take over its part of ``step``; never the window's last step's)."""

    def __init__(self, marker: str, *, step: int, rank: int | None, or_later: bool = False) -> None:
        super().__init__("KillOnce")
        self.marker, self.step, self.rank, self.or_later = marker, step, rank, or_later

    def run(self, step: stages.StepContext, batch: stages.Batch) -> stages.Batch:
        rank = step.replica.rank
        marker = self.marker if self.rank is not None else f"{self.marker}.{rank}"
        if (
            (step.spec.index == self.step or (self.or_later and step.spec.index > self.step))
            and self.rank in (rank, None)
            and step.replica.world_size > 1
            and not os.path.exists(marker)
        ):
            Path(marker).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


class WaitForWorkers(stages.Stage):
    """Test stage: at step ``step`` holds replica 0 until the cluster has ``count``
    workers (the nanny's restart of a killed one), so the next phase can use it."""

    def __init__(self, *, step: int, count: int) -> None:
        super().__init__("WaitForWorkers")
        self.step, self.count = step, count

    def run(self, step: stages.StepContext, batch: stages.Batch) -> stages.Batch:
        if step.spec.index == self.step and step.replica.rank == 0:
            from distributed import get_client

            client = get_client()
            deadline = time.monotonic() + 60
            while len(client.scheduler_info(n_workers=-1)["workers"]) < self.count:
                assert time.monotonic() < deadline, "the nanny did not restart the worker"
                time.sleep(0.1)
        return batch


def _trainer(
    x,
    y,
    *,
    marker=None,
    kill_step=0,
    kill_rank=1,
    kill_or_later=False,
    wait_step=None,
    seed=0,
    **options,
):
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    if marker is not None:
        kill = KillOnce(marker, step=kill_step, rank=kill_rank, or_later=kill_or_later)
        batch = g.add(kill, batch)
    if wait_step is not None:
        batch = g.add(WaitForWorkers(step=wait_step, count=3), batch)
    out = g.add(stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    grads = g.add(stages.Backward(), out)
    reduced = g.add(stages.AllReduce(), grads)
    g.add(stages.Update(sgd), reduced)
    schedule = dfl.schedule.Stepwise({0: 24, 2: 48, 3: 96}, lr_scaling="none")
    defaults = dict(seed=seed, progress=False, window_seconds=0.3, collective_timeout_s=20.0)
    return dfl.Trainer(g, schedule=schedule, **{**defaults, **options})


def _recovered_reference(x, y, epochs, failure):
    """Synchronous training in one process over the batches a fit on 3 replicas trains
    when one is lost in phase 0: the plan up to the commit, then the rest of the epoch
    re-split over the replicas after the recovery (the 2 survivors, or 3 when the nanny's
    restart was back in time to join the new group), then the later phases as planned."""
    trainer = _trainer(x, y)
    plans = trainer.plan(epochs, replicas=3)
    commit, after = failure["commit_step"], failure["replicas_after"]
    rest = resplit_steps(plans[0].steps, commit, lambda size: Even().split(size, after, []))
    streams = trainer.load.streams
    batches = [parts for spec, parts in streams(plans[0].steps, 0) if spec.index < commit]
    batches += [parts for _, parts in streams(rest, 0)]
    for plan in plans[1:]:
        batches += [parts for _, parts in streams(plan.steps, 0)]
    return reference_training(x, y, batches=batches, seed=0)


def _assert_exact_ledger(result, epochs):
    summary = result.ledger.summary()
    assert sorted(summary) == list(range(epochs))
    for epoch in range(epochs):
        assert summary[epoch] == {"consumed": N_SAMPLES, "unused": 0}, epoch
    indices = [s["step"] for s in result.history.steps]
    assert indices == list(range(len(indices))), "each committed step once, in order"


@pytest.mark.timeout(300)
def test_sigkill_mid_window_recovers_on_survivors_and_keeps_every_sample_once(tmp_path):
    x, y = make_data(N_SAMPLES)
    epochs = 4
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        pids_before = set(client.run(os.getpid).values())
        marker = tmp_path / "killed"
        # killed at step 27 of phase 0 (steps 0-39); held at step 39 until the nanny has
        # restarted the worker, so that phase 1 starts with it
        trainer = _trainer(x, y, marker=str(marker), kill_step=27, wait_step=39)
        # (mid-phase checkpoints too: the driver's log of this fit must replay them)
        folder = dict(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
        result = trainer.fit(epochs=epochs, client=client, **folder)
        killed_at = float(marker.read_text())
        pids_after = set(client.run(os.getpid).values())
    assert len(pids_before - pids_after) == 1, "one worker process was really killed"

    [failure] = result.history.info["failures"]
    # On a loaded machine the nanny's restart can be back before the survivors regroup
    # (usually 0.1 s after the kill); it then joins the new group at once.
    joined_at_once = bool(failure["joined"])
    assert failure["replicas_before"] == 3
    assert failure["replicas_after"] == (3 if joined_at_once else 2), failure
    assert failure["phase"] == 0 and failure["commit_step"] <= 27
    # at most the window in progress is lost, and it is replayed
    assert failure["window_steps_lost"] >= 27 - failure["commit_step"]
    recovery_s = failure["resumed_at"] - killed_at
    print(
        f"\nworker death to training resumed: {recovery_s:.2f} s; "
        f"window steps replayed: {failure['window_steps_lost']}"
    )

    _assert_exact_ledger(result, epochs)
    phases = result.history.phases
    # phase 0 finished on the survivors; the nanny restarted the killed worker, and it
    # joined at the next phase boundary (or at the recovery, when back before it)
    assert phases[0]["replicas"] == (3 if joined_at_once else 2)
    assert [p["replicas"] for p in phases[1:]] == [3, 3]
    assert [r["phase"] for r in result.history.info["regroups"]] == [0 if joined_at_once else 1]

    losses = [e["train_loss"] for e in result.history.epochs]
    assert losses[-1] < losses[0]

    # Exact: the survivors rolled back to the commit and trained on the rest of the epoch
    # as re-split; a single process following the same global batches ends the same.
    assert max_abs_diff(result.model, _recovered_reference(x, y, epochs, failure)) < 1e-5
    # the driver's log of it replays to the same commands (tests/test_driver_replay.py)
    assert_log_replays(result, phases={0, 1, 2})


@pytest.mark.timeout(240)
def test_max_workers_caps_the_first_group_and_the_spare_replaces_a_lost_replica(tmp_path):
    """replicas=None, max_workers=2 on 3 workers: the fit starts on 2 (it used to start
    on all 3), the third waits as a spare and takes the killed worker's place."""
    from dataflow.runtime.cluster import available_workers

    x, y = make_data(N_SAMPLES)
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        for nanny in list(cluster.workers.values()):  # a killed worker does not come back
            cluster.loop.add_callback(nanny.close_gracefully)
        spare = available_workers(client)[2]
        marker = str(tmp_path / "killed")
        trainer = _trainer(x, y, marker=marker, kill_step=5, max_workers=2)
        result = trainer.fit(epochs=1, client=client)
    info = result.history.info
    assert info["replicas"] == 2
    [failure] = info["failures"]
    assert failure["replicas_before"] == 2 and failure["replicas_after"] == 2, failure
    assert failure["joined"] == [spare] and spare not in failure["lost"], failure
    assert [p["replicas"] for p in result.history.phases] == [2]
    _assert_exact_ledger(result, 1)


@pytest.mark.timeout(240)
def test_too_few_workers_left_checkpoints_the_commit_raises_and_resumes(tmp_path):
    x, y = make_data(N_SAMPLES)
    epochs, folder, marker = 2, tmp_path / "checkpoints", str(tmp_path / "killed")
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        for nanny in list(cluster.workers.values()):  # nodes that do not come back
            cluster.loop.add_callback(nanny.close_gracefully)
        trainer = _trainer(x, y, marker=marker, kill_step=5, min_workers=2)
        with pytest.raises(dfl.WorkerLostError, match="min_workers=2") as caught:
            trainer.fit(epochs=epochs, client=client, checkpoint_dir=folder)
        # the survivor's state at the last window both replicas finished is on disk
        saved = CheckpointStore(folder).load_latest()
        assert saved.mid_phase and 1 <= saved.step <= 5
        assert f"A checkpoint of step {saved.step}" in str(caught.value)
        assert "resume=True" in str(caught.value)
        ledger = ledger_from_state(saved.ledger)  # the committed steps' samples, no more
        assert len(ledger.consumed(0)) == saved.step * 24
        assert len(saved.history["steps"]) == saved.step

    with (  # a new allocation: the job is started again
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        trainer = _trainer(x, y, marker=marker, kill_step=5, min_workers=2)
        result = trainer.fit(epochs=epochs, client=client, checkpoint_dir=folder, resume=True)
    assert result.history.info["resumed_from"]["step"] == saved.step
    _assert_exact_ledger(result, epochs)


@pytest.mark.timeout(240)
def test_every_replica_killed_at_once_restarts_from_the_newest_checkpoint(tmp_path):
    """No survivor holds the commit: the driver waits for the nannies to restart the
    workers and starts again from the newest (mid-phase) checkpoint."""
    x, y = make_data(N_SAMPLES)
    epochs = 3
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        trainer = _trainer(x, y, marker=str(tmp_path / "killed"), kill_step=30, kill_rank=None)
        result = trainer.fit(
            epochs=epochs, client=client, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2
        )
    assert (tmp_path / "killed.0").exists() and (tmp_path / "killed.1").exists()
    [restart] = [f for f in result.history.info["failures"] if "restarted_from_step" in f]
    assert restart["phase"] == 0 and restart["replicas_after"] == 2
    assert 0 < restart["restarted_from_step"] <= 30  # a mid-phase checkpoint of phase 0
    waited = restart["resumed_at"] - restart["detected_at"]
    print(
        f"\nevery replica killed at step 30: started again from step "
        f"{restart['restarted_from_step']} after {waited:.2f} s"
    )
    _assert_exact_ledger(result, epochs)
    losses = [e["train_loss"] for e in result.history.epochs]
    assert losses[-1] < losses[0]


class KillPoint(stages.Stage):
    """Test stage: at each step of ``steps``, the first time replica 0 reaches it, writes
    ``folder/asked-STEP`` and holds until the monkey writes ``folder/done-STEP`` (after
    its kill): every kill lands inside the fit, at a step, whatever the machine's speed."""

    def __init__(self, folder: str, steps: tuple[int, ...]) -> None:
        super().__init__("KillPoint")
        self.folder, self.steps = folder, steps

    def run(self, step: stages.StepContext, batch: stages.Batch) -> stages.Batch:
        index = step.spec.index
        asked = Path(self.folder, f"asked-{index}")
        if (
            index in self.steps
            and step.replica.rank == 0
            and step.replica.world_size > 1  # not the driver's dry run
            and not asked.exists()
        ):
            asked.write_text(str(time.time()))
            deadline = time.monotonic() + 120  # a bound on a real condition, not a pause
            while not Path(self.folder, f"done-{index}").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the monkey never killed at step {index}")
                time.sleep(0.05)
        return batch


def _chaos_monkey(client, folder: Path, steps, stop, kills, seed=10):
    """At each kill point (``KillPoint``'s ``asked-STEP``), SIGKILL a random worker
    process (the nannies restart them under new addresses), then release the point. A
    kill is not skipped because Dask was busy (it retries), only when fewer than 2
    workers live; it stops at ``stop``."""
    rng = random.Random(seed)
    for step in steps:
        while not stop.is_set() and not (folder / f"asked-{step}").exists():
            time.sleep(0.05)
        if stop.is_set():
            return
        pids = None
        while pids is None and not stop.is_set():
            try:
                pids = client.run(os.getpid)
            except Exception:  # a worker died meanwhile: ask again
                time.sleep(0.5)
        if pids is not None and len(pids) >= 2:  # keep one alive; the nannies bring the rest
            address, pid = rng.choice(sorted(pids.items()))
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append((step, address))
            except ProcessLookupError:
                pass
        (folder / f"done-{step}").write_text(str(time.time()))


@pytest.mark.timeout(300)
def test_chaos_random_kills_with_nannies_training_completes_with_exact_ledger(tmp_path):
    x, y = make_data(N_SAMPLES)
    epochs = 8  # 200 steps: 120 of 12 samples, 60 of 24, 20 of 48
    # a kill point in each phase, drawn with a seed (4 workers: 2 live at the third
    # even if no restart is up yet, so every point kills)
    rng = random.Random(10)
    steps = (rng.randrange(10, 110), rng.randrange(125, 175), rng.randrange(182, 196))
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    batch = g.add(KillPoint(str(tmp_path), steps), batch)
    out = g.add(stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    grads = g.add(stages.Backward(), out)
    g.add(stages.Update(sgd), g.add(stages.AllReduce(), grads))
    schedule = dfl.schedule.Stepwise({0: 12, 3: 24, 6: 48}, lr_scaling="none")
    # (a worker killed while a group forms leaves its peers waiting for it up to the
    # collective timeout: kept short, so such a recovery costs seconds, not a minute)
    trainer = dfl.Trainer(
        g, schedule=schedule, seed=0, progress=False, window_seconds=0.5, collective_timeout_s=10.0
    )
    kills: list = []
    stop = threading.Event()

    with (
        LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        monkey = threading.Thread(
            target=_chaos_monkey, args=(client, tmp_path, steps, stop, kills), daemon=True
        )
        monkey.start()
        try:
            # with a checkpoint after every window: should every replica die before the
            # restarted workers join (kills can land close together on a loaded machine),
            # the fit starts again from the newest one on the restarted workers
            result = trainer.fit(
                epochs=epochs, client=client, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1
            )
        finally:
            stop.set()
            monkey.join()
    failures = result.history.info.get("failures", [])
    train_seconds = result.history.info["train_seconds"]
    recoveries = [f["resumed_at"] - f["detected_at"] for f in failures if "resumed_at" in f]
    restarts = [f for f in failures if "restarted_from_step" in f]
    print(
        f"\nchaos: {len(kills)} kills, {len(failures)} recoveries ({len(restarts)} from a "
        f"checkpoint) in {train_seconds:.0f} s of "
        f"training; recovery (detected -> resumed) max {max(recoveries, default=0):.2f} s "
        f"(all: {', '.join(f'{r:.1f}' for r in sorted(recoveries))}); "
        f"replicas per phase {[p['replicas'] for p in result.history.phases]}; "
        f"joins at phases {[r['phase'] for r in result.history.info['regroups']]}"
    )
    assert [step for step, _ in kills] == list(steps), (steps, kills)  # one at each point
    assert failures, "workers were killed during the fit, so it recovered"
    _assert_exact_ledger(result, epochs)
    losses = [e["train_loss"] for e in result.history.epochs]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    # restarted workers came back: at a later recovery or phase boundary
    first_failure_phase = min(f["phase"] for f in failures if f["phase"] is not None)
    if first_failure_phase < result.history.phases[-1]["phase"]:
        assert result.history.info["regroups"], "a restarted worker rejoined the fit"


@pytest.mark.timeout(300)
def test_a_lost_parameter_store_host_is_rebuilt_from_the_commit(tmp_path):
    """``sync.Async``: replica 0's worker hosts the parameter store's shard. Killed
    mid-window, the survivors roll back to the commit, the new rank 0 rebuilds the shard
    from it, and nothing else is lost: with staleness 0 the fit equals synchronous
    training over the same batches (the same exact reference as above), and every
    sample is trained once per epoch."""
    x, y = make_data(N_SAMPLES)
    epochs = 2
    sync = dfl.sync.Async(staleness=0)
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        marker = tmp_path / "killed"
        trainer = _trainer(x, y, marker=str(marker), kill_step=27, kill_rank=0, sync=sync)
        result = trainer.fit(epochs=epochs, client=client)
    assert marker.exists()
    [failure] = result.history.info["failures"]
    # the nanny's restart may be back in time to join the new group (as above)
    joined_at_once = bool(failure["joined"])
    assert failure["replicas_before"] == 3
    assert failure["replicas_after"] == (3 if joined_at_once else 2), failure
    _assert_exact_ledger(result, epochs)
    assert max_abs_diff(result.model, _recovered_reference(x, y, epochs, failure)) < 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("leases", "servers"), [(False, 1), (True, 2)])
def test_a_lost_replica_under_async_updates_costs_only_its_update_in_flight(
    tmp_path, leases, servers
):
    """``Async(staleness=1)``, replica 2 (no store shard) killed while it computes step
    27 (with leases, the first step from 27 on that it computes: the others may take
    over its part of 27): nothing is rolled back. The survivors finish the window in
    flight without it, train again at the window's end the parts the store never applied
    (at least the one it had in flight; under leases the others took over its unclaimed
    parts already), commit the window and regroup from its end. Every sample is still
    trained once per epoch. With 2 servers each shard hands out what it lacks."""
    x, y = make_data(N_SAMPLES)
    sync = dfl.sync.Async(staleness=1, leases=leases, servers=servers)
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        marker = tmp_path / "killed"
        trainer = _trainer(
            x, y, marker=str(marker), kill_step=27, kill_rank=2, kill_or_later=leases, sync=sync
        )
        result = trainer.fit(epochs=2, client=client)
    assert marker.exists()
    [failure] = result.history.info["failures"]
    assert failure["replicas_before"] == 3  # (the nanny's restart may rejoin at once)
    assert failure["kept_window"] and failure["window_steps_lost"] == 0, failure
    assert failure["commit_step"] > 27, failure  # the window of the kill committed
    assert failure["retrained_parts"] >= 1, failure  # the part in flight, at least
    _assert_exact_ledger(result, 2)
    assert all(math.isfinite(s["loss"]) for s in result.history.steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("leases", [False, True])
def test_a_lost_replica_under_local_updates_keeps_the_period(tmp_path, leases):
    """``Local(period_steps=6)``, replica 2 killed in step 27 of the window [24, 30) (with
    leases, in the first of steps 27-29 it runs: a faster replica may have taken over its
    parts of 27 and 28, never of 29, the window's last): nothing is rolled back. The
    survivors end their period, hand in their states at the store on replica 0, train
    again the parts replica 2 trained and never handed in (without leases: its parts of
    steps 24-29; with leases, what it had claimed), and average among themselves; the
    window commits and they regroup from its end. Every sample is still trained once
    per epoch."""
    x, y = make_data(N_SAMPLES)
    sync = dfl.sync.Local(period_steps=6, leases=leases)
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        marker = tmp_path / "killed"
        trainer = _trainer(
            x, y, marker=str(marker), kill_step=27, kill_rank=2, kill_or_later=leases, sync=sync
        )
        result = trainer.fit(epochs=2, client=client)
    assert marker.exists()
    [failure] = result.history.info["failures"]
    assert failure["replicas_before"] == 3
    assert failure["kept_window"] and failure["window_steps_lost"] == 0, failure
    assert failure["commit_step"] > 27, failure  # the period of the kill committed
    assert failure["retrained_parts"] >= (1 if leases else 6), failure
    _assert_exact_ledger(result, 2)
    assert all(math.isfinite(s["loss"]) for s in result.history.steps)


@pytest.mark.timeout(120)
def test_the_driver_hears_of_a_removed_member_without_polling():
    """The executor's RemovalWatch: the scheduler's ``remove-worker`` event of a watched
    worker sets ``removed`` (so a wait on a parameter store or on local steps, where
    no task fails, notices the loss at once); another worker's leaves it alone."""
    from dataflow.driver.membership import RemovalWatch

    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(3)
        first, second, third = sorted(client.scheduler_info()["workers"])
        watch = RemovalWatch(client)
        watch.watch((first, second))
        client.retire_workers([third], close_workers=True)
        assert not watch.removed.wait(timeout=2.0)  # not a member: no word
        client.retire_workers([second], close_workers=True)
        assert watch.removed.wait(timeout=60.0)
        watch.close()
        assert not watch.watched


@pytest.mark.timeout(300)
@pytest.mark.parametrize("progress", [False, True], ids=["epochs", "scale-invariant"])
def test_a_lost_worker_leaves_the_noise_estimate_to_the_committed_steps(
    tmp_path, monkeypatch, progress
):
    """``Stepwise``'s default LR rule takes each phase's gain from the noise measured
    before it. A worker killed mid-window: the steps of the aborted window are run
    again on the survivors, and the estimate must rest on the pairs of the runs that
    were committed, each step once, never on the aborted run's (a step counted twice, or
    with a dead replica's norms, would bias the next phase's LR without a trace).
    Counting progress (``scale_invariant``), the gain also sets how many epochs of data
    each phase runs: the ledger holds each of them, each sample once."""
    fed = noise_pairs_fed(monkeypatch)
    x = make_data(N_SAMPLES)[0]
    y = learnable_labels(x)
    pairs_dir = tmp_path / "pairs"
    pairs_dir.mkdir()
    marker = tmp_path / "killed"
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    batch = g.add(KillOnce(str(marker), step=27, rank=1), batch)
    out = g.add(stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    reduced = g.add(WitnessPairs(str(pairs_dir)), g.add(stages.Backward(), out))
    g.add(stages.Update(sgd), reduced)
    schedule = dfl.schedule.Stepwise(
        {0: 24, 2: 48, 3: 96}, min_measured_steps=4, scale_invariant=progress
    )
    assert schedule.lr_scaling == "adascale"  # the default
    trainer = dfl.Trainer(
        g,
        schedule=schedule,
        seed=0,
        progress=False,
        window_seconds=0.3,
        collective_timeout_s=20.0,
        dry_run=False,  # (its steps would be witnessed too)
    )
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        result = trainer.fit(epochs=4, client=client)
        alive = set(client.run(os.getpid).values())
    [failure] = result.history.info["failures"]
    commit, resumed_at = failure["commit_step"], failure["resumed_at"]
    assert failure["phase"] == 0 and commit <= 27
    phases = result.history.phases
    _assert_exact_ledger(result, phases[-1]["end_epoch"])  # 4, or more counting progress
    if progress:  # a gain below B/B0 trains more epochs of data than of progress
        assert phases[-1]["progress_end"] >= 4
        below = any(p["gain"] < p["global_batch"] / 24 for p in phases[1:])
        assert phases[-1]["end_epoch"] > 4 or not below

    # What each committed step's replicas measured: a step before the commit from its
    # first run, a step from the commit on from its run after the recovery
    committed: dict[int, list] = {}
    lost: dict[int, list] = {}  # the killed replica's, before it died
    aborted: set[int] = set()
    for file in pairs_dir.glob("pairs.*.jsonl"):
        killed = int(file.name.split(".")[1]) not in alive
        for line in file.read_text().splitlines():
            index, *pair, at = json.loads(line)
            if index < commit or at > resumed_at:
                committed.setdefault(index, []).append(pair)
                if killed:
                    lost.setdefault(index, []).append(pair)
            else:
                aborted.add(index)
    print(f"\ncommit {commit}; steps run twice (aborted, then committed): {sorted(aborted)}")
    # steps commit..26 had every replica's allreduce before the kill
    assert aborted == set(range(commit, 27))
    got: dict[int, list] = {}
    for index, *pair in fed:
        got.setdefault(index, []).append(pair)
    steps = [s["step"] for s in result.history.steps]
    assert set(got) <= set(steps) and len(got) >= len(steps) // 2
    for index, pairs in got.items():
        # once per replica of the committed run; a window the killed replica finished
        # but whose result died with it is salvaged without its pairs (the estimate
        # stays unbiased on the others', as the step's loss is their mean)
        expected = sorted(committed[index])
        if len(pairs) < len(expected):
            assert index < commit and index in lost, (index, pairs, expected)
            expected = [p for p in expected if p not in lost[index]]
        assert len(pairs) == len(expected), (index, pairs, expected)
        for mine, theirs in zip(sorted(pairs), expected, strict=True):
            assert mine[0] == theirs[0] and mine[2] == theirs[2]  # batches
            assert mine[1] == pytest.approx(theirs[1], rel=1e-5)  # |g_r|^2
            assert mine[3] == pytest.approx(theirs[3], rel=1e-5)  # |G|^2

    # and each later phase's gain is the one of the estimate from those pairs
    for before, after in itertools.pairwise(phases):
        measured = before["measured_noise_scale"]
        assert after["noise_scale"] == (None if measured is None else pytest.approx(measured))
        if measured is not None:
            expected = adascale_gain(measured, 24, after["global_batch"])
            assert after["gain"] == pytest.approx(expected)
    assert any(p["gain"] > 1.0 for p in phases[1:]), "an estimate was trusted"
