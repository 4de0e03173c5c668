"""ZarrSource over xarray Datasets and dask arrays, and to_zarr from a Dataset."""

import dask.array as da
import numpy as np
import pytest
import torch
import xarray as xr

import dataflow as dfl
from dataflow.io import ZarrSource, stream_batches, to_zarr


def _dataset(n=30, seed=0):
    rng = np.random.default_rng(seed)
    return xr.Dataset(
        {
            # sample dimension in the middle: the source moves it first
            "density": (("z", "sample", "x"), rng.normal(size=(3, n, 4)).astype(np.float32)),
            "params": (("sample", "p"), rng.normal(size=(n, 2)).astype(np.float32)),
            "grid": (("z",), np.arange(3.0)),  # no sample dim: not a training variable
        }
    )


def _all(source, batch=7):
    batches = list(stream_batches(source, batch, seed=1))
    order = np.concatenate([b.indices for b in batches])
    return batches, order


def test_an_xarray_zarr_v2_store_round_trips_by_dimension_name(tmp_path):
    ds = _dataset()
    ds.to_zarr(
        tmp_path / "v2.zarr",
        zarr_format=2,
        encoding={"density": {"chunks": (3, 4, 4)}, "params": {"chunks": (8, 2)}},
    )
    expected_x = np.moveaxis(ds["density"].values, 1, 0)
    for store in (tmp_path / "v2.zarr", xr.open_zarr(tmp_path / "v2.zarr")):
        source = ZarrSource(store, x="density", y="params", sample_dim="sample")
        assert source.num_samples == 30 and source.chunk_samples == 4
        assert not isinstance(source.store, xr.Dataset)  # an opened Dataset: read its store
        batches, order = _all(source)
        assert sorted(order.tolist()) == list(range(30))
        for b in batches:
            assert np.array_equal(b.x.numpy(), expected_x[b.indices])
            assert np.array_equal(b.y.numpy(), ds["params"].values[b.indices])


def test_a_dataset_opened_from_zarr_still_catches_a_missing_chunk(tmp_path):
    _dataset().to_zarr(
        tmp_path / "v2.zarr", zarr_format=2, encoding={"density": {"chunks": (3, 5, 4)}}
    )
    (tmp_path / "v2.zarr" / "density" / "0.2.0").unlink()  # xarray would give NaN
    source = ZarrSource(xr.open_zarr(tmp_path / "v2.zarr"), "density", sample_dim="sample")
    with pytest.raises(dfl.ChunkMissingError, match=r"density/0\.2\.0"):
        _all(source)


def test_to_zarr_writes_a_dataset_readable_by_name(tmp_path):
    ds = _dataset().chunk({"sample": 7})  # dask-backed: written slab by slab
    to_zarr(tmp_path / "d.zarr", ds, sample_dim="sample", chunk_mb=4 * 12 * 4 / 1e6)
    source = ZarrSource(tmp_path / "d.zarr", x="density", y="params", sample_dim="sample")
    assert source.chunk_samples == 4
    batches, _ = _all(source)
    for b in batches:
        assert np.array_equal(b.x.numpy(), np.moveaxis(ds["density"].values, 1, 0)[b.indices])
    with pytest.raises(dfl.ConfigError, match=r"sample_dim=None.*\['p', 'sample', 'x', 'z'\]"):
        to_zarr(tmp_path / "e.zarr", ds)


def test_in_memory_and_dask_backed_datasets(tmp_path):
    ds = _dataset()
    for data in (ds, ds.chunk({"sample": 9})):
        source = ZarrSource(data, x="density", y="params", sample_dim="sample")
        batches, order = _all(source)
        assert sorted(order.tolist()) == list(range(30))
        for b in batches:
            assert np.array_equal(b.y.numpy(), ds["params"].values[b.indices])
    assert np.diff(
        ZarrSource(ds.chunk({"sample": 9}), "density", sample_dim="sample").chunk_bounds
    ).tolist() == [9, 9, 9, 3]


def test_a_dask_array_is_x_itself():
    data = np.arange(50 * 3, dtype=np.float64).reshape(50, 3)
    source = ZarrSource(da.from_array(data, chunks=(12, 3)))
    batches, order = _all(source)
    assert sorted(order.tolist()) == list(range(50)) and batches[0].y is None
    for b in batches:
        assert np.array_equal(b.x.numpy(), data[b.indices])


def test_several_inputs_arrive_as_a_tuple_and_unsupervised_has_no_y():
    ds = _dataset()
    source = ZarrSource(ds, x=["density", "params"], y=None, sample_dim="sample")
    batch = source.read(np.array([4, 0]))
    assert isinstance(batch.x, tuple) and batch.y is None
    assert batch.x[0].shape == (2, 3, 4) and batch.x[1].shape == (2, 2)
    assert torch.equal(batch.x[1], torch.from_numpy(ds["params"].values[[4, 0]]))


def test_bad_names_and_dimensions_say_what_exists():
    ds = _dataset()
    with pytest.raises(dfl.io.VariableNotFoundError, match=r"'pressure'.*'density'"):
        ZarrSource(ds, x="pressure", sample_dim="sample")
    with pytest.raises(dfl.DataError, match=r"sample_dim='time'.*\('z', 'sample', 'x'\)"):
        ZarrSource(ds, x="density", sample_dim="time")
    with pytest.raises(dfl.DataError, match=r"sample counts differ"):
        ZarrSource(ds, x="density", y="params", sample_dim=0)  # axis 0: z, then sample
