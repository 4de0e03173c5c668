import pickle

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.io import VariableNotFoundError, ZarrSource, to_zarr


def _write(tmp_path, n=20, per_chunk=5, name="data.zarr"):
    """x: (n, 3, 2) float32, y: (n,) int64, ``per_chunk`` samples per chunk of x."""
    rng = np.random.default_rng(0)
    x = rng.random((n, 3, 2), dtype=np.float32)
    y = np.arange(n, dtype=np.int64)
    path = to_zarr(tmp_path / name, x, y, chunk_mb=per_chunk * 3 * 2 * 4 / 1e6)
    return path, x, y


@settings(
    deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 30),
    width=st.integers(1, 4),
    per_chunk=st.integers(1, 12),
    data=st.data(),
)
def test_round_trip_in_any_order(tmp_path_factory, n, width, per_chunk, data):
    x = np.arange(n * width, dtype=np.float32).reshape(n, width) * 0.5
    y = torch.arange(n) * 3
    path = to_zarr(
        tmp_path_factory.mktemp("rt") / "s.zarr", x, y, chunk_mb=per_chunk * width * 4 / 1e6
    )
    source = ZarrSource(path, "x", "y", shuffle=False)
    assert source.num_samples == n
    assert source.chunk_samples == min(n, per_chunk)
    indices = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n)), dtype=np.int64)
    batch = source.read(indices)
    assert batch.size == len(indices)
    assert batch.x.shape == (len(indices), width)
    assert np.array_equal(batch.x.numpy(), x[indices])
    assert torch.equal(batch.y, y[torch.from_numpy(indices)])


def test_zarr_format_2_store(tmp_path):
    x = np.arange(24, dtype=">f4").reshape(12, 2)  # big-endian, as v2 stores often are
    array = zarr.open_array(
        tmp_path / "v2.zarr", mode="w", shape=x.shape, chunks=(5, 2), dtype=x.dtype, zarr_format=2
    )
    array[:] = x
    source = ZarrSource(tmp_path / "v2.zarr", x=None)
    indices = np.array([11, 0, 6, 5])
    assert np.array_equal(source.read(indices).x.numpy(), x[indices])
    (tmp_path / "v2.zarr" / "1.0").unlink()
    with pytest.raises(dfl.ChunkMissingError, match=r"'1\.0'.*store is incomplete"):
        source.read(np.array([6]))


def test_sample_dim_is_moved_first(tmp_path):
    x = np.arange(60, dtype=np.float32).reshape(3, 10, 2)  # samples along dim 1
    group = zarr.open_group(tmp_path / "g.zarr", mode="w")
    group.create_array("x", shape=x.shape, dtype=x.dtype, chunks=(3, 4, 2))[:] = x
    source = ZarrSource(group, "x", sample_dim=1)
    assert source.num_samples == 10 and source.chunk_samples == 4
    indices = np.array([9, 1, 4])
    assert np.array_equal(source.read(indices).x.numpy(), np.moveaxis(x, 1, 0)[indices])


def test_opened_array_is_x(tmp_path):
    path, x, _ = _write(tmp_path)
    source = ZarrSource(zarr.open_array(path / "x", mode="r"), x=None)
    assert np.array_equal(source.read(np.array([3, 2])).x.numpy(), x[[3, 2]])


def test_missing_variable_lists_the_arrays_there(tmp_path):
    path, _, _ = _write(tmp_path)
    with pytest.raises(VariableNotFoundError, match=r"y='labels'.*\['x', 'y'\]"):
        ZarrSource(path, "x", "labels")
    with pytest.raises(KeyError):  # also a KeyError, and a DataError
        ZarrSource(path, "pressure")
    with pytest.raises(dfl.DataError, match=r"x=None.*name the input.*\[.x., .y.\]"):
        ZarrSource(path, x=None)


def test_sample_count_mismatch(tmp_path):
    group = zarr.open_group(tmp_path / "g.zarr", mode="w")
    group.create_array("x", shape=(10, 2), dtype="f4")
    group.create_array("y", shape=(9,), dtype="i8")
    with pytest.raises(dfl.DataError, match=r"x \('x'\) has 10, y \('y'\) has 9"):
        ZarrSource(tmp_path / "g.zarr", "x", "y")


def test_non_numeric_dtype(tmp_path):
    group = zarr.open_group(tmp_path / "g.zarr", mode="w")
    group.create_array("x", shape=(4,), dtype=str)
    with pytest.raises(dfl.DataError, match="not numeric"):
        ZarrSource(tmp_path / "g.zarr", "x")
    with pytest.raises(dfl.DataError, match=r"x has dtype <U1.*astype"):
        to_zarr(tmp_path / "w.zarr", np.array(["a", "b"]))


def test_bad_sample_dim(tmp_path):
    path, _, _ = _write(tmp_path)
    with pytest.raises(dfl.DataError, match=r"sample_dim=3.*use 0\.\.2"):
        ZarrSource(path, "x", sample_dim=3)
    with pytest.raises(dfl.DataError, match=r"sample_dim=1.*for y"):
        ZarrSource(path, "x", "y", sample_dim=1)


def test_writer_validates_inputs(tmp_path):
    with pytest.raises(dfl.DataError, match="x has 10 samples but y has 9"):
        to_zarr(tmp_path / "a.zarr", np.zeros((10, 2)), np.zeros(9))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(dfl.DataError, match="not a zarr store"):
        to_zarr(tmp_path / "notes", np.zeros((2, 2)))
    assert (tmp_path / "notes" / "keep.txt").exists()
    with pytest.raises(dfl.ConfigError, match="compressor"):
        to_zarr(tmp_path / "b.zarr", np.zeros((2, 2)), compressor="lz9")


def test_writer_chunks_whole_samples(tmp_path):
    x = np.zeros((100, 250), dtype=np.float32)  # 1000 bytes a sample
    to_zarr(tmp_path / "c.zarr", x, chunk_mb=0.01)
    array = zarr.open_array(tmp_path / "c.zarr" / "x", mode="r")
    assert array.chunks == (10, 250)
    assert array.metadata.zarr_format == 3
    assert array.nchunks_initialized == 10  # all-zero chunks are written too


def test_missing_chunk_is_named_and_others_still_read(tmp_path):
    path, x, _ = _write(tmp_path, n=20, per_chunk=5)
    (path / "x" / "c" / "2" / "0" / "0").unlink()  # samples 10..14
    source = ZarrSource(path, "x", "y")
    with pytest.raises(dfl.ChunkMissingError, match=r"'x/c/2/0/0'.*store is incomplete"):
        source.read(np.array([0, 12]))
    batch = source.read(np.array([19, 4, 9, 15]))
    assert np.array_equal(batch.x.numpy(), x[[19, 4, 9, 15]])


def test_corrupt_chunk_raises_chunk_read_error(tmp_path):
    path, x, _ = _write(tmp_path, n=20, per_chunk=5)
    (path / "x" / "c" / "1" / "0" / "0").write_bytes(b"not zstd at all" * 8)
    source = ZarrSource(path, "x")
    with pytest.raises(dfl.ChunkReadError, match=r"'x/c/1/0/0'.*corrupt") as info:
        source.read(np.array([2, 7]))
    assert isinstance(info.value, OSError)
    assert np.array_equal(source.read(np.array([12, 3])).x.numpy(), x[[12, 3]])


def test_pickle_round_trip_reopens(tmp_path):
    path, x, _ = _write(tmp_path)
    source = ZarrSource(path, "x", "y", shuffle=False)
    source.read(np.array([1]))
    clone = pickle.loads(pickle.dumps(source))
    assert clone.shuffle is False and clone.num_samples == 20 and clone.chunk_samples == 5
    batch = clone.read(np.array([13, 2]))
    assert np.array_equal(batch.x.numpy(), x[[13, 2]])
    assert batch.y.tolist() == [13, 2]


def test_fsspec_urls(tmp_path):
    path, x, _ = _write(tmp_path)
    source = ZarrSource(path.as_uri(), "x")  # file://...
    assert np.array_equal(source.read(np.array([5, 0])).x.numpy(), x[[5, 0]])
    url = f"memory://dataflow-test-{tmp_path.name}/m.zarr"
    group = zarr.open_group(url, mode="w")
    group.create_array("x", shape=(6, 2), dtype="f4", chunks=(4, 2))[:] = x[:6, 0]
    source = ZarrSource(url, "x")
    assert np.array_equal(source.read(np.array([5, 1])).x.numpy(), x[[5, 1], 0])


def test_pipeline_plans_over_a_zarr_source(tmp_path):
    path, _, _ = _write(tmp_path, n=40)
    pipe = dfl.Pipeline(
        model=lambda: torch.nn.Flatten(),
        device="cpu",
        loss=lambda out, target: out.sum() * 0,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        source=ZarrSource(path, "x", "y"),
        schedule=dfl.schedule.Fixed(8),
    )
    plans = pipe.plan(epochs=1, replicas=2)
    assert plans
