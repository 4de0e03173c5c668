"""``Pipeline.evaluate``: a trained model scored on a test set after the fit, in this
process or spread over a cluster's workers, with the pipeline's transforms and metrics.
Real zarr stores on disk; a real LocalCluster for the spread."""

from __future__ import annotations

import itertools
import os
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, sgd

import dataflow as dfl
from dataflow import stages

SAMPLES = 200


def write_test_set(tmp_path, samples: int = SAMPLES) -> str:
    rng = np.random.default_rng(7)
    x = rng.gamma(2.0, size=(samples, 1, 8, 8)).astype(np.float32)  # positive: Log1p
    y = rng.integers(0, 3, size=samples).astype(np.int64)
    return dfl.io.to_zarr(str(tmp_path / "test.zarr"), x, y, chunk_mb=0.0115)


def pipeline(source, **options) -> dfl.Pipeline:
    return dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=F.cross_entropy,
        optimizer=sgd,
        source=source,
        transforms=[dfl.ops.Log1p(), dfl.ops.RandomFlip(axes=(2, 3))],
        schedule=dfl.schedule.Fixed(16),
        progress=False,
        **options,
    )


def by_hand(model, path) -> dict[str, float]:
    """The test set's mean loss and accuracy, batch by batch, Log1p applied (the flip is
    an augmentation: training only)."""
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    batch = source.read(np.arange(source.num_samples))
    with torch.no_grad():
        output = model(torch.log1p(torch.as_tensor(batch.x)))
    y = torch.as_tensor(batch.y)
    return {
        "loss": float(F.cross_entropy(output, y)),
        "accuracy": float(stages.accuracy(output, y)),
        "samples": source.num_samples,
    }


def test_a_model_is_scored_with_the_pipelines_transforms_and_metrics(tmp_path):
    path = write_test_set(tmp_path)
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    pipe = pipeline(source, eval_source=source, metrics={"accuracy": stages.accuracy})
    torch.manual_seed(0)
    model = TinyCNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scores = pipe.evaluate(source, model)
    expected = by_hand(model, path)
    assert scores == pytest.approx(expected, rel=1e-6)
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    only = pipe.evaluate(source, model, metrics={"loss": F.cross_entropy}, batch_size=7)
    assert set(only) == {"loss", "samples"} and only["loss"] == pytest.approx(expected["loss"])
    plain = pipeline(source)  # no held-out set in the fit: the loss alone
    assert set(plain.evaluate(source, model)) == {"loss", "samples"}


def test_a_chunk_missing_from_the_test_set_stops_the_evaluation_naming_it(tmp_path):
    path = write_test_set(tmp_path)
    os.remove(os.path.join(path, "x", "c", "1", "0", "0", "0"))
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    with pytest.raises(dfl.ChunkMissingError, match=r"x.*c/1/0/0/0"):
        pipeline(source).evaluate(source, TinyCNN())


def test_what_is_not_a_model_or_a_test_set_is_named(tmp_path):
    source = dfl.io.ArraySource(np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64))
    pipe = pipeline(source)
    with pytest.raises(dfl.ConfigError, match=r"evaluate\(model=OrderedDict\): give the trained"):
        pipe.evaluate(source, TinyCNN().state_dict())
    with pytest.raises(dfl.ConfigError, match=r"a source with samples to score"):
        pipe.evaluate(object(), TinyCNN())


@pytest.mark.slow
def test_the_best_epochs_weights_scored_on_the_cluster_give_the_fits_own_score(client, tmp_path):
    """keep_best meets evaluate: the kept weights, scored on the held-out set spread over
    the cluster's two workers, give the held-out loss the fit recorded for that epoch;
    the spread scores equal this process's (to float rounding: other batches)."""
    path = write_test_set(tmp_path, samples=96)
    held_out = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    rng = np.random.default_rng(0)
    x = rng.gamma(2.0, size=(128, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=128).astype(np.int64)
    pipe = pipeline(dfl.io.ArraySource(x, y), eval_source=held_out)
    result = pipe.fit(3, client=client, keep_best="eval_loss")
    best = result.history.info["best"]
    spread = pipe.evaluate(held_out, result.best_model, client=client)
    assert spread["samples"] == 96
    assert spread["loss"] == pytest.approx(best["value"], rel=1e-6)
    here = pipe.evaluate(held_out, result.best_model)
    # (float32 batches of 48 on each worker, one of 96 here: equal to rounding)
    assert spread["loss"] == pytest.approx(here["loss"], rel=1e-6)


@pytest.mark.parametrize("align", [1, 4, 16, 300])
@pytest.mark.parametrize("samples", [1, 5, 64, 200, 201])
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_shares_cover_every_sample_once_on_block_boundaries(samples, parts, align):
    from dataflow.evaluation import contiguous_shares

    shares = contiguous_shares(samples, parts, align)
    assert shares[0][0] == 0 and shares[-1][1] == samples
    assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))  # contiguous
    assert all(lo < hi for lo, hi in shares)  # none empty
    assert len(shares) == min(parts, -(-samples // align))  # as many as blocks allow
    assert all(lo % align == 0 for lo, _ in shares)  # no two share a block
    sizes = [-(-(hi - lo) // align) for lo, hi in shares]  # blocks per share
    assert max(sizes) - min(sizes) <= 1 + (samples % align != 0)  # even, the last short


class KillsItsWorkerOnce:
    """A metric that SIGKILLs the worker process it first runs on (once per marker file),
    then scores as cross entropy."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, output, y):
        if not os.path.exists(self.marker):
            with open(self.marker, "w") as file:
                file.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return F.cross_entropy(output, y)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_killed_while_it_scores_its_share_leaves_the_scores_whole(tmp_path):
    """The share of a worker SIGKILLed mid-evaluation is scored by another: every sample
    counted once, the same scores as in this process."""
    from distributed import Client, LocalCluster

    path = write_test_set(tmp_path)
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    torch.manual_seed(0)
    model = TinyCNN()
    marker = str(tmp_path / "killed")
    metrics = {"loss": KillsItsWorkerOnce(marker)}
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        spread = pipeline(source).evaluate(source, model, client=client, metrics=metrics)
    assert os.path.exists(marker)  # a worker really died
    here = pipeline(source).evaluate(source, model, metrics={"loss": F.cross_entropy})
    assert spread["samples"] == 200
    assert spread["loss"] == pytest.approx(here["loss"], rel=1e-6)


def _share_of(stage, model, device, lo, hi):
    return (lo, hi)


@pytest.mark.slow  # real worker processes
def test_shares_whose_scattered_inputs_were_lost_are_submitted_again(client, monkeypatch):
    """Dask's active memory manager keeps one copy of the scattered stage and model once
    no task on a worker needs them, so a worker lost later can take it: the shares
    still to run are cancelled. The first gather here meets that (the second share's
    future cancelled, as the scheduler does then): that share alone is submitted again,
    with its inputs scattered anew, and every share's result comes back in order."""
    from concurrent.futures import CancelledError

    from dataflow.evaluation import run_shares

    submit, gather = client.submit, client.gather
    submitted, gathers = [], []

    def submit_and_note(*args, **kwargs):
        submitted.append(args[4:6])  # (lo, hi)
        return submit(*args, **kwargs)

    def gather_losing_the_inputs_once(futures):
        gathers.append(len(futures))
        if len(gathers) == 1:
            futures[0].result()  # the first share done; the second one's inputs lost
            client.cancel([futures[1]])
            raise CancelledError("scattered data lost with a worker")
        return gather(futures)

    monkeypatch.setattr(client, "submit", submit_and_note)
    monkeypatch.setattr(client, "gather", gather_losing_the_inputs_once)
    got = run_shares(client, "evaluate", _share_of, object(), torch.nn.Linear(2, 2), "cpu", 10)
    assert got == [(0, 5), (5, 10)] and len(gathers) == 2
    assert submitted == [(0, 5), (5, 10), (5, 10)]  # the second share twice


def test_the_stage_can_be_copied_to_another_worker_while_a_share_reads_with_it(tmp_path):
    """``Pipeline.evaluate`` scatters the stage once; a worker that lost its copy (Dask's
    memory manager drops it once its share is done) and then runs a stolen share fetches
    the copy of a worker still scoring with it. That copy holds the reading in progress
    (a prefetch thread, locks): it could not be pickled, and ``evaluate`` waited for
    good (seen in ``bench_layerwise_accuracy.py``). Now the reading stays behind."""
    import pickle

    from dataflow.stages.evaluate import Evaluate

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 40)
    for source in (
        dfl.io.ArraySource(x, y, shuffle=False),
        dfl.io.ZarrSource(
            dfl.io.to_zarr(tmp_path / "held.zarr", x, y), x="x", y="y", shuffle=False
        ),
    ):
        stage = Evaluate(source, metrics={"loss": F.cross_entropy}, batch_size=8)
        outputs = stage.outputs(TinyCNN(), torch.device("cpu"), 0, 40)
        next(outputs)  # a share part-way through its batches
        copy = pickle.loads(pickle.dumps(stage))
        outputs.close()
        scores = copy.score_range(TinyCNN(), torch.device("cpu"), 0, 40)
        assert scores["count"] == 40 and np.isfinite(scores["loss"])
