"""Spatial layouts with everything else (issue 16, item 7), on real LocalClusters.

Checkpoints and exact resume (also on another layout), a worker SIGKILLed in the
middle of a window (its sample group is lost; the survivors go on, or the fit saves
the commit and stops naming the smallest layout that would run), the balancer
splitting the batch over sample groups, and BatchNorm over them (``sync_batchnorm``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    TinyCNN,
    assert_the_balancer_followed_the_throttle,
    lagging_driver,
    make_data,
    max_abs_diff,
    reference_training,
    sgd,
    tiny_pipeline,
)
from distributed import Client, LocalCluster

import dataflow as dfl
from dataflow import stages
from dataflow.checkpoint import CheckpointStore, ledger_from_state
from dataflow.core.window import WHOLE
from dataflow.planning.plan import resplit_steps
from dataflow.schedule.balance import Even

pytestmark = pytest.mark.slow  # real worker processes, really killed

SPATIAL2 = dfl.Layout(spatial=2)
N_SAMPLES = 192


def _pipeline(x, y, **options) -> dfl.Pipeline:
    defaults = dict(
        # two phases: a boundary checkpoint between them, mid-phase ones in phase 0
        schedule=dfl.schedule.Stepwise({0: 16, 2: 32}, lr_scaling="none"),
        window_steps=2,  # pinned: checkpoint points in every phase, however fast the machine
        layout=SPATIAL2,
        bucket_mb=0.0005,  # several buckets: the weighted allreduce in pieces
    )
    return tiny_pipeline(x, y, **{**defaults, **options})


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name


def _every_sample_once(result, epochs: int, n: int) -> None:
    for epoch in range(epochs):
        assert sorted(result.ledger.consumed(epoch).tolist()) == list(range(n)), epoch
    steps = [s["step"] for s in result.history.steps]
    assert steps == list(range(len(steps))), "each committed step once, in order"


def _keep_up_to(store: CheckpointStore, path) -> None:
    """Delete every checkpoint newer than ``path``, as if the run had died after it."""
    for newer in [p for p in store.checkpoints() if p.name > path.name]:
        newer.unlink()
        CheckpointStore.manifest_path(newer).unlink()


# -- checkpoints and exact resume ---------------------------------------------------------
class DropCNN(torch.nn.Module):
    """TinyCNN with dropout on the region and before the head: the group's shared mask
    generator must come back with a resume."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.drop = torch.nn.Dropout(0.3)
        self.conv2 = torch.nn.Conv2d(4, 4, 3)
        self.drop2 = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.conv(x)))
        x = torch.relu(self.conv2(x))
        return self.head(self.drop2(x.flatten(1)))


def test_a_resumed_spatial_fit_with_dropout_draws_the_same_masks(client, tmp_path):
    x, y = make_data(64)
    folder = dict(checkpoint_dir=tmp_path, keep_checkpoints=1000)
    full = _pipeline(x, y, model=DropCNN).fit(2, client=client, checkpoint_every=2, **folder)
    mid = [c for c in full.history.info["checkpoints"] if c["mid_phase"]]
    store = CheckpointStore(tmp_path, keep=1000)
    _keep_up_to(store, store.path(mid[0]["step"]))
    resumed = _pipeline(x, y, model=DropCNN).fit(2, client=client, resume=True, **folder)
    assert resumed.history.info["resumed_from"]["step"] == mid[0]["step"]
    _same_weights(full.model, resumed.model)
    assert [s["loss"] for s in resumed.history.steps] == [s["loss"] for s in full.history.steps]


def test_spatial_resume_is_bit_identical_and_resumes_on_another_layout(client, tmp_path):
    x, y = make_data(96)  # phase 0: epochs 0-1, 6 steps of 16 each; phase 1: 3 of 32
    epochs = 3
    plain = _pipeline(x, y).fit(epochs, client=client)
    folder = dict(checkpoint_dir=tmp_path, keep_checkpoints=1000)
    full = _pipeline(x, y).fit(epochs, client=client, checkpoint_every=2, **folder)
    _same_weights(plain.model, full.model)  # writing checkpoints changes nothing
    written = full.history.info["checkpoints"]
    assert [c["phase"] for c in written if not c["mid_phase"]] == [0, 1]
    mid = [c for c in written if c["mid_phase"]]
    assert {c["phase"] for c in mid} == {0}, written  # phase 1: 2 windows, the 2nd ends it
    store = CheckpointStore(tmp_path, keep=1000)

    # stopped inside phase 0, and at the phase boundary: resumed, the same bits (each
    # resumed fit writes the boundary checkpoints after its start again)
    boundary = next(c for c in written if not c["mid_phase"])
    for point in (mid[len(mid) // 2], boundary):
        _keep_up_to(store, store.path(point["step"]))
        saved = store.load_latest()
        assert saved.step == point["step"] and len(saved.replica_rng) == 2  # per worker
        resumed = _pipeline(x, y).fit(epochs, client=client, resume=True, **folder)
        assert resumed.history.info["resumed_from"]["step"] == point["step"]
        _same_weights(full.model, resumed.model)
        assert [s["loss"] for s in resumed.history.steps] == [s["loss"] for s in full.history.steps]
        _every_sample_once(resumed, epochs, len(x))

    # the partitioned model's state has the plain model's keys: a spatial=2 checkpoint
    # resumes as sample parallelism (2 replicas of 1 worker), the rest of the phase
    # re-split over them
    _keep_up_to(store, store.path(mid[0]["step"]))
    other = _pipeline(x, y, layout=None).fit(epochs, client=client, resume=True, **folder)
    assert other.history.info["resumed_from"]["step"] == mid[0]["step"]
    assert other.history.phases[0]["replicas"] == 2
    _every_sample_once(other, epochs, len(x))
    losses = [e["train_loss"] for e in other.history.epochs]
    assert losses[-1] < losses[0]


# -- a worker SIGKILLed in a window ------------------------------------------------------
class KillOnce(stages.Stage):
    """Test stage: SIGKILLs its own worker at step ``step`` on spatial rank ``part`` of
    replica ``rank``, once per ``marker`` file (written first)."""

    def __init__(self, marker: str, *, step: int, rank: int, part: int) -> None:
        super().__init__("KillOnce")
        self.marker, self.step, self.rank, self.part = marker, step, rank, part

    def run(self, step: stages.StepContext, batch: stages.Batch) -> stages.Batch:
        spatial = step.replica.spatial
        if (
            spatial is not None
            and spatial.group.size > 1  # not the driver's dry run
            and step.spec.index == self.step
            and (step.replica.rank, spatial.rank) == (self.rank, self.part)
            and not os.path.exists(self.marker)
        ):
            Path(self.marker).write_text(str(time.time()))
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
    x, y, *, kill=None, wait=None, layout=SPATIAL2, source=None, held_out=None, **options
) -> dfl.Trainer:
    """``kill``: (marker, step, replica, spatial rank); ``wait``: (step, workers);
    ``source``: the training data (else ``x``, ``y`` in memory); ``held_out``: a source
    to evaluate on at each epoch's end."""
    g = dfl.Graph()
    batch = g.add(stages.Load(source or dfl.io.ArraySource(x, y)))
    if kill is not None:
        marker, step, rank, part = kill
        batch = g.add(KillOnce(str(marker), step=step, rank=rank, part=part), batch)
    if wait is not None:
        batch = g.add(WaitForWorkers(step=wait[0], count=wait[1]), batch)
    out = g.add(stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    reduced = g.add(stages.AllReduce(), g.add(stages.Backward(), out))
    node = g.add(stages.Update(sgd), reduced)
    if held_out is not None:
        metrics = {"loss": torch.nn.functional.cross_entropy}
        g.add(stages.Evaluate(held_out, metrics=metrics), node)
    defaults = dict(
        schedule=dfl.schedule.Stepwise({0: 24, 2: 48}, lr_scaling="none"),
        layout=layout,
        seed=0,
        progress=False,
        window_steps=2,  # pinned: the kill falls inside a window after some commits
        collective_timeout_s=20.0,
    )
    return dfl.Trainer(g, **{**defaults, **options})


@pytest.fixture(scope="module")
def cluster():
    """Four worker processes with nannies (a killed worker comes back under a new
    address), shared by the tests below (each starts by waiting for the count it needs)."""
    with (
        LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        yield cluster, client


@pytest.mark.timeout(240)
@pytest.mark.parametrize("data", ["memory", "zarr-evaluated"])
def test_a_killed_worker_takes_its_group_the_other_goes_on_and_the_pair_forms_again(
    cluster, tmp_path, data
):
    """4 workers, 2 sample groups; a worker of group 1 is killed in phase 0: group 0 ends
    the phase alone (as trained on one process: exact), then the partner and the
    restarted worker form group 1 again for phase 1 (or at once, when the restart is
    back before the recovery). Every sample once per epoch.

    ``zarr-evaluated``: the spatial cell of the fault matrix (test_fault_matrix.py):
    the data in zarr and a held-out evaluation at each epoch's end, the whole held-out
    set scored once whatever the groups were (with the memory, no-evaluation run it
    gives each spatial pairing of those two factors)."""
    x, y = make_data(N_SAMPLES)
    epochs, marker = 4, tmp_path / "killed"
    _, client = cluster
    client.wait_for_workers(4)
    pids_before = set(client.run(os.getpid).values())
    options = {}
    if data == "zarr-evaluated":
        hx, hy = make_data(60, seed=1)
        stores = (
            dfl.io.to_zarr(tmp_path / "train.zarr", x, y),
            dfl.io.to_zarr(tmp_path / "held_out.zarr", hx, hy),
        )
        source = dfl.io.ZarrSource(stores[0], x="x", y="y")
        held_out = dfl.io.ZarrSource(stores[1], x="x", y="y", shuffle=False)
        options = dict(source=source, held_out=held_out)
    # killed at step 5 of phase 0 (steps 0-15; windows of 2): the commit is step 4;
    # held at step 15 until the nanny has restarted the worker: phase 1 can use it
    trainer = _trainer(x, y, kill=(marker, 5, 1, 1), wait=(15, 4), **options)
    result = trainer.fit(epochs=epochs, client=client)
    pids_after = set(client.run(os.getpid).values())
    assert marker.exists() and len(pids_before - pids_after) == 1, "one worker was killed"

    [failure] = result.history.info["failures"]
    assert failure["reason"] == "lost workers" and failure["phase"] == 0
    assert len(failure["lost"]) == 1 and failure["commit_step"] == 4
    assert "resumed_at" in failure
    # the nanny's restart is usually back only after the recovery; when it is back in
    # time, it and the partner form group 1 again at once (as a spare does, below)
    assert failure["replicas_before"] == 2 and failure["replicas_after"] in (1, 2)
    alone = failure["replicas_after"] == 1
    phases = result.history.phases
    # phase 0 ended on group 0 alone, or on both groups again; phase 1 (epochs 2-3, the
    # batch of 48) on both
    assert [p["replicas"] for p in phases] == ([1, 2] if alone else [2, 2])
    [regroup] = result.history.info["regroups"]
    assert regroup["phase"] == (1 if alone else 0)
    assert len(regroup["joined"]) == 2  # the partner, the new one
    _every_sample_once(result, epochs, N_SAMPLES)

    # exact: group 0 rolled back to the commit and trained on the rest of phase 0 alone
    # (or with the new group 1); single-process training on the same global batches
    # ends the same
    if alone:
        plans = trainer.plan(epochs, replicas=2)
        rest = resplit_steps(plans[0].steps, 4, lambda size: Even().split(size, 1, []))
        streams = trainer.load.streams
        batches = [parts for spec, parts in streams(plans[0].steps, 0) if spec.index < 4]
        batches += [parts for _, parts in streams(rest, 0)]
        batches += [parts for _, parts in streams(plans[1].steps, 0)]
    else:
        batches = trainer.sample_plan(epochs, replicas=2)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) < 1e-5
    if data == "zarr-evaluated":
        evaluated = result.history.epochs
        assert [e["held_out_samples"] for e in evaluated] == [60] * epochs, evaluated
        expected.eval()
        with torch.no_grad():
            logits = expected(torch.from_numpy(hx))
            loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(hy))
        assert evaluated[-1]["eval_loss"] == pytest.approx(float(loss), rel=1e-4)
        # every group's result holds the whole set's sums (with two groups, the fit's
        # group of all four workers summed them: a group lost after it scored takes
        # no share with it; alone, a group scores the whole set itself)
        scored = [
            evals
            for event in result.driver_log.events
            if type(event).__name__ == "WindowDone"
            for window in event.results.values()
            for evals in (getattr(window, "evals", None) or {}).values()
        ]
        assert all(e["count"] == 60 for e in scored) and any(e.get(WHOLE) for e in scored)


@pytest.mark.timeout(240)
def test_a_spare_worker_and_the_partner_form_a_new_group_at_once(cluster, tmp_path):
    """5 workers: 2 sample groups and a spare. A worker of group 1 is killed: its partner
    and the spare form group 1 again right away (they take group 0's state), and the
    fit ends as if nothing happened: single-process training on the same batches."""
    x, y = make_data(N_SAMPLES)
    epochs, marker = 2, tmp_path / "killed"
    spatial_cluster, client = cluster
    spatial_cluster.scale(5)
    client.wait_for_workers(5)
    trainer = _trainer(x, y, kill=(marker, 5, 1, 1))
    result = trainer.fit(epochs=epochs, client=client)
    assert marker.exists()
    [failure] = result.history.info["failures"]
    assert failure["replicas_before"] == 2 and failure["replicas_after"] == 2
    assert failure["commit_step"] == 4 and len(failure["joined"]) == 2
    [regroup] = result.history.info["regroups"]
    assert regroup["phase"] == 0 and regroup["joined"] == failure["joined"]
    assert [p["replicas"] for p in result.history.phases] == [2]
    _every_sample_once(result, epochs, N_SAMPLES)
    batches = trainer.sample_plan(epochs, replicas=2)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) < 1e-5


@pytest.mark.timeout(180)
def test_the_last_group_broken_saves_the_commit_and_names_the_layout_that_runs(tmp_path):
    """2 workers, one sample group: one is killed and does not come back. The partner
    holds the commit: it is saved, and the error names the layout one worker runs;
    resumed with that layout, the fit ends as single-process training would."""
    x, y = make_data(N_SAMPLES)
    epochs, folder, marker = 2, tmp_path / "ckpt", tmp_path / "killed"
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        for nanny in list(cluster.workers.values()):  # nodes that do not come back
            cluster.loop.add_callback(nanny.close_gracefully)
        trainer = _trainer(x, y, kill=(marker, 5, 0, 0))  # the group's first worker
        with pytest.raises(dfl.WorkerLostError) as caught:
            trainer.fit(epochs=epochs, client=client, checkpoint_dir=folder)
        message = str(caught.value)
        print(f"\n{message}")
        assert (
            "1 worker(s) left; spatial=2 needs 2 per replica: restart with >= 2 workers, or "
            "resume with layout=dfl.Layout(spatial=1)" in message
        )
        saved = CheckpointStore(folder).load_latest()
        # the commit: windows of 2, killed at step 5, so step 4; or step 2 when the driver
        # had not yet collected the killed worker's result of window [2, 4) (a loaded
        # machine): a result held by a dead worker is lost with it
        assert saved.mid_phase and saved.step in (2, 4), saved.step
        assert (
            f"A checkpoint of step {saved.step} (the last window every replica finished) "
            in message
        )
        assert saved.model_state and saved.optimizer_state  # the partner's (slot 0 now)
        assert len(ledger_from_state(saved.ledger).consumed(0)) == saved.step * 24

        resumed = _trainer(x, y, layout=dfl.Layout(spatial=1)).fit(
            epochs=epochs, client=client, checkpoint_dir=folder, resume=True
        )
    assert resumed.history.info["resumed_from"]["step"] == saved.step
    _every_sample_once(resumed, epochs, N_SAMPLES)
    batches = trainer.sample_plan(epochs, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(resumed.model, expected) < 1e-5


@pytest.mark.timeout(180)
def test_the_last_group_broken_with_a_spare_starts_again_from_the_partners_save(
    tmp_path, monkeypatch
):
    """3 workers: one sample group and a spare. A worker of the group is killed: no group
    is left, but its partner holds the commit; it is saved, and the fit starts again
    from it on the workers there are (the spare and the partner, or the restarted one).

    The driver lags behind the replicas (it gathers nothing for a while after queuing
    its first windows): the replicas may run only ``WINDOWS_AHEAD`` windows past its
    commit, so the commit is among those the partner keeps. (When every window was
    queued at once, a driver that lagged two windows, on a loaded machine, left the
    partner without the commit: "cannot roll back to step 0".)"""
    lagging_driver(monkeypatch, lambda n: 3.0 if n == 0 else 0.0)  # after the first
    x, y = make_data(N_SAMPLES)
    epochs, folder, marker = 2, tmp_path / "ckpt", tmp_path / "killed"
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        trainer = _trainer(x, y, kill=(marker, 5, 0, 1))
        result = trainer.fit(epochs=epochs, client=client, checkpoint_dir=folder)
    assert marker.exists()
    [failure] = result.history.info["failures"]
    # the commit: windows of 2, killed at step 5, so step 4; or step 2 when the driver
    # had not yet collected the killed worker's result of window [2, 4): a result held by
    # a dead worker is lost with it, but window [4, 6) is queued only after [0, 2) commits
    commit = failure["commit_step"]
    assert failure["reason"] == "every replica lost" and commit in (2, 4), failure
    assert failure["restarted_from_step"] == commit and failure["replicas_after"] == 1
    assert [c["step"] for c in result.history.info["checkpoints"] if c["mid_phase"]] == [commit]
    _every_sample_once(result, epochs, N_SAMPLES)
    batches = trainer.sample_plan(epochs, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) < 1e-5


# -- the balancer splits the batch over sample groups -------------------------------------
class ConvNet(torch.nn.Module):
    """Enough compute per sample that a step's time is mostly compute."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


@pytest.mark.timeout(180)
def test_the_balancer_gives_a_throttled_sample_group_a_smaller_share(cluster):
    """Both workers of group 1 throttled 3x: the group's measured speed counts the
    throttle's pause, and each phase after the first is split by the balancer from the
    speeds measured before it. The decisions are checked, not the share they come to
    (a quarter, were a step all compute; a shared 2-core machine moves it)."""
    _, client = cluster
    client.wait_for_workers(4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(384, 1, 24, 24)).astype(np.float32)
    y = rng.integers(0, 3, size=384)
    pipe = _pipeline(
        x,
        y,
        model=ConvNet,
        schedule=dfl.schedule.Fixed(96, epochs_per_phase=1),
        balancer=dfl.balance.Throughput(smoothing=1.0),
        throttle={1: 3.0},  # replica 1: the second sample group, both its workers
        window_steps=None,
        replicas=2,
    )
    result = pipe.fit(epochs=3, client=client)
    phases = result.history.phases
    assert [p["replicas"] for p in phases] == [2, 2, 2]
    assert phases[0]["local_batches"] == [48, 48]
    print(f"\nthrottled group: split {[p['local_batches'] for p in phases]}")
    assert_the_balancer_followed_the_throttle(phases, slow=1, factor=3.0)
    _every_sample_once(result, 3, len(x))


@pytest.mark.timeout(180)
def test_sync_batchnorm_reduces_over_every_sample_group_as_one_process(cluster):
    """4 workers, 2 sample groups of 2 spatial ranks, 36 samples at B=32 split 3:29 and
    then (0, 4) (group 0 has no sample and takes part): with ``sync_batchnorm`` each
    BatchNorm layer reduces every group's regions of its samples, each group's part
    scaled by its share, and the fit is the one-process loop's (weights, running
    statistics, and the batch counts, which the phase's end once summed over the two
    ranks of a group)."""
    from test_sync_batchnorm import BatchNormCNN, distance, one_process

    _, client = cluster
    client.wait_for_workers(4)
    x, y = make_data(36)
    pipe = tiny_pipeline(
        x,
        y,
        model=BatchNormCNN,
        batch=32,
        balancer=dfl.balance.Proportional((3, 29)),
        layout=dfl.Layout(spatial=2),
        sync_batchnorm=True,
        replicas=2,
    )
    assert [s.local_batches for s in pipe.plan(epochs=1, replicas=2)[0].steps] == [(3, 29), (0, 4)]
    result = pipe.fit(epochs=2, client=client)
    assert result.history.info["replicas"] == 2
    expected = one_process(x, y, pipe.sample_plan(epochs=2, replicas=2))
    assert distance(result.model, expected) <= 1e-5
