"""Training from a real zarr store on disk, on the real LocalCluster."""

import shutil

import numpy as np
import pytest
import torch.nn.functional as F
from conftest import TinyCNN, make_data, max_abs_diff, reference_training, sgd

import dataflow as dfl

pytestmark = pytest.mark.slow


def zarr_pipeline(path, **options):
    return dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=F.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ZarrSource(path, x="x", y="y"),
        schedule=dfl.schedule.Fixed(16),
        progress=False,
        **options,
    )


def test_training_from_zarr_equals_training_from_memory(client, tmp_path):
    x, y = make_data(64)
    path = dfl.io.to_zarr(tmp_path / "train.zarr", x, y, chunk_mb=0.001)  # many chunks
    pipe = zarr_pipeline(path)
    result = pipe.fit(epochs=2, client=client)
    batches = pipe.sample_plan(epochs=2, replicas=2)
    assert all(len(p) == 8 for parts in batches for p in parts)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-5
    # The ledger: each sample exactly once per epoch, each replica what the plan gave it.
    for epoch in range(2):
        assert result.ledger.consumed(epoch).tolist() == list(range(64))
        for rank in range(2):
            planned = np.concatenate([parts[rank] for parts in batches[epoch * 4 : epoch * 4 + 4]])
            assert result.ledger.consumed(epoch, rank).tolist() == sorted(planned.tolist())
    # Whole chunks: per epoch, at most one chunk (the cut between the replicas) twice.
    chunks = len(dfl.io.ZarrSource(path, "x").chunk_bounds) - 1
    assert sum(result.history.phases[0]["chunks_decoded"]) <= 2 * (chunks + 1)


def test_a_missing_chunk_stops_training_instead_of_feeding_zeros(client, tmp_path):
    x, y = make_data(64)
    path = dfl.io.to_zarr(tmp_path / "train.zarr", x, y, chunk_mb=0.001)
    chunk_dirs = sorted((p for p in (tmp_path / "train.zarr" / "x" / "c").iterdir()), key=str)
    victim = chunk_dirs[len(chunk_dirs) // 2]
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    pipe = zarr_pipeline(path, dry_run=False)  # a worker meets the hole, not the driver
    with pytest.raises(dfl.ChunkMissingError, match=r"x/c/\d+"):
        pipe.fit(epochs=1, client=client)
