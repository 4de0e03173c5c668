"""``Pipeline.predict``: a trained model's outputs on every sample of a source, written to
a zarr store, in this process or by the cluster's workers (each a share of whole output
chunks). Real zarr stores on disk; a real LocalCluster for the spread."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zarr
from conftest import TinyCNN
from test_evaluate_model import pipeline, write_test_set

import dataflow as dfl
from dataflow.prediction import RowWriter


def by_hand(model, path) -> np.ndarray:
    """Every sample's output in one batch, Log1p applied (the flip is training's)."""
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    x = torch.as_tensor(source.read(np.arange(source.num_samples)).x)
    with torch.no_grad():
        return model(torch.log1p(x)).numpy()


def test_every_samples_output_is_written_in_order_with_the_pipelines_transforms(tmp_path):
    path = write_test_set(tmp_path)
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    torch.manual_seed(0)
    model = TinyCNN()
    out = pipeline(source).predict(source, model, tmp_path / "out.zarr", batch_size=7)
    written = zarr.open_group(out, mode="r")["prediction"]
    assert written.shape == (200, 3) and written.dtype == np.float32
    np.testing.assert_allclose(written[:], by_hand(model, path), rtol=1e-5, atol=1e-6)
    assert model.training  # the user's model is left as it was
    # the store reads back as a source: each chunk whole and checksummed
    back = dfl.io.ZarrSource(out, x="prediction", shuffle=False)
    assert back.num_samples == 200


def test_rows_out_of_order_land_where_they_belong_and_runs_write_whole_chunks(tmp_path):
    array = zarr.open_group(str(tmp_path / "rows.zarr"), mode="w").create_array(
        "p", shape=(10, 2), chunks=(4, 2), dtype="f4"
    )
    rows = RowWriter(array)
    values = np.arange(20, dtype=np.float32).reshape(10, 2)
    rows.add(np.arange(0, 3), values[0:3])  # a run: nothing written before a boundary
    assert rows.written == 0
    rows.add(np.arange(3, 6), values[3:6])  # crosses row 4: rows 0-3 written whole
    assert rows.written == 4
    rows.add(np.array([9, 7]), values[[9, 7]])  # out of order: the run first, then these
    rows.add(np.array([6, 8]), values[[6, 8]])
    rows.flush()
    assert rows.written == 10
    np.testing.assert_array_equal(array[:], values)


def test_a_model_without_one_output_tensor_or_a_missing_chunk_is_named(tmp_path):
    path = write_test_set(tmp_path)
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)

    class TwoOutputs(TinyCNN):
        def forward(self, x):
            out = super().forward(x)
            return out, out

    with pytest.raises(dfl.ConfigError, match=r"the model returned tuple, not a tensor"):
        pipeline(source).predict(source, TwoOutputs(), tmp_path / "out.zarr")
    os.remove(os.path.join(path, "x", "c", "1", "0", "0", "0"))
    with pytest.raises(dfl.ChunkMissingError, match=r"x.*c/1/0/0/0"):
        pipeline(source).predict(source, TinyCNN(), tmp_path / "out.zarr")


@pytest.mark.slow
def test_the_workers_write_their_shares_and_the_store_equals_one_process(client, tmp_path):
    """Two workers, outputs in chunks of 16 rows: each writes whole chunks of its own
    share (96 + 104 rows), straight to the store; it equals the outputs one process
    writes (to float rounding: other batches), and a test set without labels works."""
    path = write_test_set(tmp_path)
    source = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    torch.manual_seed(1)
    model = TinyCNN()
    pipe = pipeline(source)
    chunk_mb = 16 * 3 * 4 / 1e6  # 16 rows of 3 float32 outputs
    out = pipe.predict(source, model, tmp_path / "spread.zarr", client=client, chunk_mb=chunk_mb)
    spread = zarr.open_group(out, mode="r")["prediction"]
    assert spread.chunks == (16, 3)
    np.testing.assert_allclose(spread[:], by_hand(model, path), rtol=1e-5, atol=1e-6)
    unlabelled = dfl.io.ZarrSource(path, x="x", shuffle=False)
    again = pipe.predict(unlabelled, model, tmp_path / "again.zarr", client=client)
    np.testing.assert_allclose(zarr.open_group(again)["prediction"][:], spread[:], rtol=1e-6)
