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
from conftest import TinyCNN
from test_evaluate_transforms import last_step

import dataflow as dfl
from dataflow import stages

SAMPLES, BATCH = 200, 32
METRICS = {"loss": F.cross_entropy, "accuracy": stages.accuracy}


def held_out(tmp_path) -> str:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=SAMPLES).astype(np.int64)
    return dfl.io.to_zarr(str(tmp_path / "held.zarr"), x, y, chunk_mb=0.0115)  # 5 chunks


class CountingSource(dfl.io.ZarrSource):
    """A real ZarrSource that counts the chunks it is asked to decode."""

    decoded: list[int]

    def read_chunks(self, chunks):
        self.decoded = [*getattr(self, "decoded", []), *chunks]
        return super().read_chunks(chunks)


def scores(source, model) -> dict[str, float]:
    evaluate = stages.Evaluate(source, metrics=METRICS, batch_size=BATCH, transforms=())
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
