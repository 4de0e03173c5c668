"""to_zarr writes zarr format 2 as well as 3, and ZarrSource reads both back equal."""

import numpy as np
import pytest
import xarray as xr

import dataflow as dfl
from dataflow.tools.cli import main


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_arrays_round_trip_in_either_format(tmp_path, zarr_format):
    x = np.random.default_rng(0).normal(size=(40, 2, 3)).astype(np.float32)
    y = np.arange(40)
    path = tmp_path / "s.zarr"
    dfl.io.to_zarr(path, x, y, zarr_format=zarr_format, chunk_mb=0.0001)
    marker = ".zgroup" if zarr_format == 2 else "zarr.json"
    assert (path / marker).exists()
    batch = dfl.io.ZarrSource(path, x="x", y="y").read(np.arange(40))
    np.testing.assert_array_equal(batch.x.numpy(), x)
    np.testing.assert_array_equal(batch.y.numpy(), y)


def test_a_v2_dataset_keeps_its_dimension_names_for_xarray(tmp_path):
    dataset = xr.Dataset({"t": (("time", "a"), np.arange(60.0).reshape(20, 3))})
    path = tmp_path / "d.zarr"
    dfl.io.to_zarr(path, dataset, sample_dim="time", zarr_format=2)
    back = xr.open_zarr(path, zarr_format=2, consolidated=False)
    assert back["t"].dims == ("time", "a")
    np.testing.assert_array_equal(back["t"].values, dataset["t"].values)


def test_convert_writes_format_2(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((10, 4), dtype=np.float32))
    src, dest = str(tmp_path / "x.npy"), str(tmp_path / "x.zarr")
    assert main(["convert", src, dest, "--format", "2"]) == 0
    assert (tmp_path / "x.zarr" / ".zgroup").exists()


def test_an_unknown_format_is_refused(tmp_path):
    with pytest.raises(dfl.ConfigError, match="zarr_format"):
        dfl.io.to_zarr(tmp_path / "s.zarr", np.ones((2, 2)), zarr_format=4)
