"""Real LocalCluster, real worker processes, real gloo collectives."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, make_data, max_abs_diff, reference_training, sgd, tiny_pipeline

import dataflow as dfl
from dataflow import stages
from dataflow.driver import executor

pytestmark = pytest.mark.slow


def fit(client, x, y, *, batch, epochs, **options):
    options.setdefault("bucket_mb", 0.0005)  # ~500 B: several buckets, real overlap
    return tiny_pipeline(x, y, batch=batch, **options).fit(epochs=epochs, client=client)


def test_two_replicas_equal_single_process_training(client):
    x, y = make_data(160)  # 5 steps of 32 per epoch, 4 epochs: 20 steps
    result = fit(client, x, y, batch=32, epochs=4)
    batches = tiny_pipeline(x, y, batch=32).sample_plan(epochs=4, replicas=2)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert len(result.history.steps) == 20
    assert result.history.phases[0]["local_batches"] == [16, 16]
    assert max_abs_diff(result.model, expected) <= 1e-5


def test_uneven_split_and_a_replica_with_zero_samples(client):
    # 36 samples at B=32 split 3:29: steps of (3, 29) then a short step of (0, 4).
    x, y = make_data(36)
    split = dfl.balance.Proportional((3, 29))
    steps = tiny_pipeline(x, y, batch=32, balancer=split).plan(epochs=1, replicas=2)[0].steps
    assert [s.local_batches for s in steps] == [(3, 29), (0, 4)]
    # One step per task (tiny window_seconds): many windows, still exact.
    result = fit(client, x, y, batch=32, epochs=10, balancer=split, window_seconds=1e-4)
    batches = tiny_pipeline(x, y, batch=32, balancer=split).sample_plan(epochs=10, replicas=2)
    assert [len(part) for part in batches[1]] == [0, 4]
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-5
    assert result.history.phases[0]["windows"] >= 19


def test_same_seed_gives_bit_identical_weights(client):
    x, y = make_data(96)
    a = fit(client, x, y, batch=24, epochs=2, seed=7)
    b = fit(client, x, y, batch=24, epochs=2, seed=7)
    c = fit(client, x, y, batch=24, epochs=2, seed=8)
    assert max_abs_diff(a.model, b.model) == 0.0
    assert max_abs_diff(a.model, c.model) > 0.0
    assert [s["loss"] for s in a.history.steps] == [s["loss"] for s in b.history.steps]


class ClipGradNorm(stages.Stage):
    """A user stage between AllReduce and Update: clips the reduced gradient."""

    def __init__(self, max_norm: float) -> None:
        super().__init__("ClipGradNorm")
        self.max_norm = max_norm

    def run(self, step, grads):
        norm = torch.nn.utils.clip_grad_norm_(step.replica.model.parameters(), self.max_norm)
        step.metrics["grad_norm"] = norm
        return grads


def test_custom_stage_between_allreduce_and_update(client):
    x, y = make_data(64)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(stages.Forward(TinyCNN, F.cross_entropy), batch)
    grads = g.add(stages.Backward(), out)
    reduced = g.add(stages.AllReduce(bucket_mb=0.001), grads)
    clipped = g.add(ClipGradNorm(0.05), reduced)
    g.add(stages.Update(sgd), clipped)
    trainer = dfl.Trainer(g, schedule=dfl.schedule.Fixed(16), progress=False)
    result = trainer.fit(epochs=2, client=client)
    batches = trainer.sample_plan(epochs=2, replicas=2)
    expected = reference_training(
        x,
        y,
        batches=batches,
        seed=0,
        after_backward=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05),
    )
    unclipped = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-5
    assert max_abs_diff(result.model, unclipped) > 1e-3  # the stage really ran
    assert "ClipGradNorm" in result.history.info["stages"]


def test_evaluate_and_history_json(client, tmp_path):
    x, y = make_data(96)
    result = dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=F.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ArraySource(x[:64], y[:64]),
        eval_source=dfl.io.ArraySource(x[64:], y[64:], shuffle=False),
        metrics={"loss": F.cross_entropy, "accuracy": stages.accuracy},
        schedule=dfl.schedule.Fixed(16),
        progress=False,
    ).fit(epochs=2, client=client)
    history = result.history
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    with torch.no_grad():
        logits = result.model(torch.from_numpy(x[64:]))
        expected_loss = F.cross_entropy(logits, torch.from_numpy(y[64:])).item()
    assert history.epochs[-1]["eval_loss"] == pytest.approx(expected_loss, rel=1e-5)
    phase = history.phases[0]
    assert phase["global_batch"] == 16 and phase["lr"] == 0.05
    assert len(phase["samples_per_second"]) == 2 and min(phase["samples_per_second"]) > 0
    # The session cluster's workers start with Dask's MALLOC_TRIM_THRESHOLD_: undone.
    assert all(w["malloc_relaxed"] for w in history.info["workers"])
    # The Dask profiler, paused on the replica workers during the fit, runs again.
    running = client.run(lambda dask_worker: dask_worker.periodic_callbacks["profile"].is_running())
    assert all(running.values())
    path = history.to_json(tmp_path / "history.json")
    again = dfl.History.from_json(path)
    assert again.steps == history.steps and again.info["replicas"] == 2


class FailOnReplica(stages.Stage):
    def __init__(self, rank: int, step: int) -> None:
        super().__init__("FailOnReplica")
        self.rank, self.step = rank, step

    def run(self, step, batch):
        if step.replica.rank == self.rank and step.spec.index == self.step:
            raise RuntimeError("disk on fire")
        return batch


def test_a_failing_replica_fails_the_fit_loudly_and_frees_the_cluster(client, monkeypatch):
    """Replica 1 raises its own error at step 3 while replica 0 waits in the allreduce:
    the fit raises replica 1's error, and the abort releases replica 0 (the next fit on
    the same cluster trains). The driver's grace for the other replicas' errors is cut
    to 1 s: replica 0 fails with none of its own, and the default 5 s were pure wait."""
    monkeypatch.setattr(executor, "FAILURE_GRACE_S", 1.0)
    x, y = make_data(64)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    batch = g.add(FailOnReplica(rank=1, step=3), batch)
    out = g.add(stages.Forward(TinyCNN, F.cross_entropy), batch)
    g.add(stages.Update(sgd), g.add(stages.AllReduce(), g.add(stages.Backward(), out)))
    trainer = dfl.Trainer(g, schedule=dfl.schedule.Fixed(8), progress=False, dry_run=False)
    where = r"\(in stage 'FailOnReplica' on replica 1, step 3\)"  # (its note, in the message)
    with pytest.raises(dfl.ReplicaError, match=rf"replica 1 .* failed {where}: RuntimeError: disk"):
        trainer.fit(epochs=2, client=client)
    # Replica 0 was blocked in an allreduce: the abort must have released it.
    x, y = make_data(64)
    result = fit(client, x, y, batch=16, epochs=1)
    assert len(result.history.steps) == 4


def test_nan_loss_stops_training(client):
    x, y = make_data(64)
    x[5] = float("nan")
    # caught on the replicas before the update (a LossError, more precisely a NonFiniteError)
    with pytest.raises(dfl.LossError, match=r"non-finite loss or gradient at step \d+"):
        fit(client, x, y, batch=16, epochs=1)


def test_embedded_local_cluster_when_no_client(capsys):
    x, y = make_data(48)
    result = tiny_pipeline(x, y, progress=True).fit(epochs=1)
    out = capsys.readouterr().out
    assert "LocalCluster with" in out and "dashboard" in out and "trained 1 epoch(s)" in out
    assert result.history.info["replicas"] >= 1
    workers = result.history.info["workers"]
    assert all(w["torch_threads"] == 1 and w["device"] == "cpu" for w in workers)


class TinyBatchNormCNN(TinyCNN):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.head(torch.relu(self.conv2(x)).flatten(1))


def test_batchnorm_statistics_are_averaged_over_replicas(client):
    x, y = make_data(64)
    # fit raises ReplicaError if the replicas' buffers differ after a phase.
    result = tiny_pipeline(x, y, model=TinyBatchNormCNN).fit(epochs=2, client=client)
    norm = result.model.norm
    assert norm.num_batches_tracked.item() == 8
    assert torch.isfinite(norm.running_mean).all() and norm.running_mean.abs().sum() > 0
