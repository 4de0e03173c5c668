"""How Evaluate reads a held-out store: a chunked one (zarr) as training reads it, each
chunk decoded once and a remote store's objects fetched many at once, with the scores
the batch-by-batch reads give. Real zarr stores on disk and on S3 (moto behind the
tests' latency proxy)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ObservedReads, TinyCNN
from test_evaluate_transforms import last_step

import dataflow as dfl
from dataflow import stages
from dataflow.stages.evaluate import held_out_batches

SAMPLES, BATCH = 200, 32
METRICS = {"loss": F.cross_entropy, "accuracy": stages.accuracy}


def held_out(tmp_path) -> str:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=SAMPLES).astype(np.int64)
    return dfl.io.to_zarr(str(tmp_path / "held.zarr"), x, y, chunk_mb=0.0115)  # 5 chunks


class CountingSource(ObservedReads, dfl.io.ZarrSource):
    """A real ZarrSource that counts the chunks it is asked to decode."""

    decoded: list[int]

    def observe(self, chunks):
        self.decoded = [*getattr(self, "decoded", []), *chunks]


def scores(source, model, metrics=METRICS) -> dict[str, float]:
    evaluate = stages.Evaluate(source, metrics=metrics, batch_size=BATCH, transforms=())
    return evaluate.evaluate_shard(last_step(evaluate, model))


def batch_by_batch(source, model) -> dict[str, float]:
    """The sums over the held-out batches, each read with ``source.read``."""
    sums = dict.fromkeys(METRICS, 0.0)
    with torch.no_grad():
        for start in range(0, SAMPLES, BATCH):
            batch = source.read(np.arange(start, min(SAMPLES, start + BATCH)))
            output = model(torch.as_tensor(batch.x))
            for key, fn in METRICS.items():
                sums[key] += float(fn(output, torch.as_tensor(batch.y))) * batch.size
    return {"count": SAMPLES, **sums}


def test_a_zarr_held_out_set_is_read_chunk_by_chunk_with_the_scores_of_batch_reads(tmp_path):
    path = held_out(tmp_path)
    source = CountingSource(path, x="x", y="y")
    sizes = np.diff(source.chunk_bounds)
    assert len(sizes) == 5 and (sizes % BATCH).all()  # batches straddle chunks
    torch.manual_seed(0)
    model = TinyCNN()
    got = scores(source, model)
    assert sorted(source.decoded) == [0, 1, 2, 3, 4]  # each chunk decoded once
    assert got == pytest.approx(batch_by_batch(dfl.io.ZarrSource(path, x="x", y="y"), model))
    assert model.training  # back to training mode


def test_a_held_out_chunk_missing_from_the_store_stops_the_evaluation_naming_it(tmp_path):
    """zarr fills a missing chunk with the fill value: the scores would be of zeros."""
    path = held_out(tmp_path)
    os.remove(os.path.join(path, "x", "c", "2", "0", "0", "0"))
    with pytest.raises(dfl.ChunkMissingError, match=r"x.*c/2/0/0/0"):
        scores(dfl.io.ZarrSource(path, x="x", y="y"), TinyCNN())


@pytest.mark.slow
def test_a_held_out_set_on_s3_fetches_its_objects_many_at_once(s3, tmp_path):
    """Each GET waits a round trip: the held-out chunks are in flight together, not one
    batch's after another's, and the scores are the local copy's."""
    path = held_out(tmp_path)
    url = s3.upload(path, "evaluate-reads.zarr")
    remote = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
    torch.manual_seed(0)
    model = TinyCNN()
    s3.proxy.reset_counts()
    s3.proxy.delay, s3.proxy.rendezvous = 0.01, 3  # the first GET waits for two more
    try:
        got = scores(remote, model)
    finally:
        s3.proxy.delay, s3.proxy.rendezvous = 0.0, 1
    assert s3.proxy.peak_chunk_gets >= 3, s3.proxy.methods
    assert got == pytest.approx(batch_by_batch(dfl.io.ZarrSource(path, x="x", y="y"), model))


# -- windows of a large array (PatchSource) ----------------------------------------------
class CountingPatches(dfl.io.PatchSource):
    """A real PatchSource that counts the units it is asked to read."""

    units_read: list[int]

    def read_chunks(self, chunks):
        self.units_read = [*getattr(self, "units_read", []), *chunks]
        return super().read_chunks(chunks)


def windows(tmp_path, source_type=dfl.io.PatchSource, shuffle=True):
    """The 8 x 8 tiles of two 64 x 48 fields and their labels: in units of blocks of
    windows (shuffled: several), or of runs of them in C order (not shuffled)."""
    from test_patch_source import write_2d

    path, _ = write_2d(tmp_path)
    grid = dict(patch={"lat": 8, "lon": 8}, stride={"lat": 5, "lon": 6})
    return source_type(path, ["a", "b"], "lab", block=2, shuffle=shuffle, **grid)


def corner_class(output, y):
    """Cross-entropy against each tile's corner label."""
    return F.cross_entropy(output, y.reshape(len(y), -1)[:, 0])


TILE_METRICS = {"loss": corner_class}


def tile_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2 * 8 * 8, 3))


def test_held_out_windows_are_batched_unit_by_unit_and_every_shard_is_whole(tmp_path):
    """Pure: in index order each unit's windows would be spread over the shard; unit by
    unit, one unit is decoded at a time. The replicas' shards still split the windows."""
    source = windows(tmp_path)
    members = source.chunk_members
    assert len(members) > 3
    n = source.num_samples
    unit_of = np.empty(n, dtype=np.int64)
    for unit, held in enumerate(members):
        unit_of[held] = unit
    shards = []
    for rank in range(3):
        lo, hi = n * rank // 3, n * (rank + 1) // 3
        batches = held_out_batches(source, lo, hi, BATCH)
        order = np.concatenate(batches)
        assert sorted(order.tolist()) == list(range(lo, hi))  # the shard, each once
        assert (np.diff(unit_of[order]) >= 0).all()  # unit after unit
        assert all(len(b) == BATCH for b in batches[:-1])
        shards.append(order)
    assert sorted(np.concatenate(shards).tolist()) == list(range(n))
    # a sample-major source: index order, as before
    assert [b.tolist() for b in held_out_batches(object(), 3, 10, 4)] == [[3, 4, 5, 6], [7, 8, 9]]


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_window_held_out_set_reads_each_unit_once_with_the_scores_of_batch_reads(
    tmp_path, shuffle
):
    """Read batch by batch, every batch read again each unit it touched (a 16k-window
    field: 11.3 s an evaluation, now 0.15 s)."""
    source = windows(tmp_path, CountingPatches, shuffle)
    model = tile_model()
    got = scores(source, model, TILE_METRICS)
    assert sorted(source.units_read) == list(range(len(source.chunk_members)))  # each once
    n = source.num_samples
    want = 0.0
    plain = windows(tmp_path / "again", shuffle=shuffle)
    with torch.no_grad():
        for start in range(0, n, BATCH):
            batch = plain.read(np.arange(start, min(n, start + BATCH)))
            want += float(corner_class(model(batch.x), batch.y)) * batch.size
    assert got == pytest.approx({"count": n, "loss": want})


def test_a_nan_output_on_a_held_out_window_names_that_window(tmp_path):
    """Batches of windows are not runs of indices: the error still names the window."""
    source = windows(tmp_path)
    window = int(source.chunk_members[1][3])  # in a later unit, inside a batch
    its_x = source.read(np.array([window])).x[0]

    class NaNOnThatWindow(torch.nn.Module):
        def forward(self, x):
            out = torch.zeros(len(x), 3)
            out[(x == its_x).flatten(1).all(dim=1)] = float("nan")
            return out

    with pytest.raises(dfl.DataError, match=rf"held-out sample {window} of eval_source"):
        scores(source, NaNOnThatWindow(), TILE_METRICS)


@pytest.mark.parametrize("kind", ["zarr", "patch"])
def test_a_missing_held_out_chunk_is_named_before_the_fit_starts(tmp_path, kind):
    """The evaluation's own check comes at the first epoch's end, after a whole epoch of
    training: a held-out chunk missing is named before any worker is asked for (the
    fit's client is an address nobody listens at: reaching for it would fail otherwise)."""
    import zarr
    from conftest import make_data, sgd

    x, y = make_data(64)
    train = dfl.io.to_zarr(tmp_path / "train.zarr", x, y, chunk_mb=0.001)
    if kind == "zarr":
        held = held_out(tmp_path)
        hole = "x/c/3/0/0/0"
        os.remove(os.path.join(held, hole))
        eval_source = dfl.io.ZarrSource(held, x="x", y="y", shuffle=False)
    else:
        field = tmp_path / "field.zarr"
        group = zarr.open_group(field, mode="w")
        values = np.random.default_rng(0).normal(size=(16, 8, 8)).astype(np.float32)
        group.create_array("f", shape=values.shape, dtype=values.dtype, chunks=(4, 8, 8))[:] = (
            values
        )
        hole = "f/c/2/0/0"
        os.remove(field / hole)
        eval_source = dfl.io.PatchSource(field, "f", "f", patch={0: 4}, shuffle=False)
    pipe = dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=F.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ZarrSource(train, x="x", y="y"),
        eval_source=eval_source,
        schedule=dfl.schedule.Fixed(16),
        progress=False,
        dry_run=False,
    )
    with pytest.raises(dfl.ChunkMissingError, match=f"'{hole}'.*among the chunks checked"):
        pipe.fit(epochs=1, client="tcp://127.0.0.1:1")
