"""A store given by its path whose arrays are CF-encoded (packed, masked, ``_Unsigned``)
is read as the data they encode, as xarray reads it, by both sources and by
``normalization_stats``; before, its path gave the stored integers and the fill value
as data. Real zarr stores on disk, written by xarray."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

import dataflow as dfl
from dataflow.core.errors import ChunkMissingError
from dataflow.io.cf_stores import cf_encoding

xr = pytest.importorskip("xarray")


@pytest.mark.parametrize(
    ("attrs", "dtype", "found"),
    [
        ({"scale_factor": 0.01, "_FillValue": -1}, "int16", ["scale_factor", "_FillValue"]),
        ({"add_offset": 273.0}, "int16", ["add_offset"]),
        ({"_Unsigned": "true", "_FillValue": -1}, "int8", ["_Unsigned", "_FillValue"]),
        ({"_FillValue": "AAAAAAAA+H8="}, "float64", []),  # zarr v3's NaN, as base64 bytes
        ({"_FillValue": float("nan")}, "float32", []),  # NaN reads as NaN either way
        ({"_FillValue": 1e20}, "float32", ["_FillValue"]),
        ({"missing_value": [-999.0, float("nan")]}, "float64", ["missing_value"]),
        ({"_FillValue": -1}, "int64", ["_FillValue"]),
        ({"units": "K", "long_name": "temperature"}, "float32", []),
    ],
)
def test_the_attributes_that_change_values_are_found(attrs, dtype, found):
    assert cf_encoding(attrs, dtype) == found


@pytest.fixture
def packed_store(tmp_path):
    """ERA5's packing (int16, ``scale_factor``, ``_FillValue``) with a masked cell, a
    float label with xarray's default NaN fill, unsigned bytes, chunked (5, 8, 8)."""
    rng = np.random.default_rng(4)
    field = 0.1 + rng.random((20, 16, 16))
    field[7, 3, 3] = np.nan
    unsigned = rng.integers(0, 255, (20, 16, 16)).astype(np.uint8)
    unsigned[2, 3, 3] = 255  # (its fill value)
    dims = ("time", "lat", "lon")
    dataset = xr.Dataset(
        {
            "t": (dims, field),
            "bytes": (dims, unsigned),
            "label": (("time",), np.arange(20, dtype=np.float32)),
        }
    )
    encoding = {
        "t": {"dtype": "int16", "scale_factor": 0.001, "_FillValue": -1, "chunks": (5, 8, 8)},
        "bytes": {"dtype": "int8", "_Unsigned": "true", "_FillValue": -1, "chunks": (5, 8, 8)},
        "label": {"chunks": (5,)},
    }
    path = tmp_path / "packed.zarr"
    dataset.to_zarr(path, encoding=encoding, consolidated=False)
    return path


def xarray_values(path, name):
    return xr.open_dataset(path, engine="zarr", chunks=None, consolidated=False)[name].values


@pytest.mark.parametrize("name", ["t", "bytes"])
def test_a_cf_encoded_store_read_by_its_path_gives_xarray_s_values(packed_store, name):
    want = xarray_values(packed_store, name)
    assert np.isnan(want).any()  # (a masked cell: stored as the fill value)
    source = dfl.io.ZarrSource(
        str(packed_store), x=name, y="label", sample_dim="time", shuffle=False
    )
    assert "(CF-decoded)" in repr(source) and "label (CF" not in repr(source)
    batch = source.read(np.arange(20))
    np.testing.assert_array_equal(batch.x.numpy(), want)
    np.testing.assert_array_equal(batch.y.numpy(), np.arange(20, dtype=np.float32))
    windows = dfl.io.PatchSource(
        packed_store, name, patch={"lat": 8, "lon": 8}, shuffle=False, nan="mask"
    )
    x = windows.read(np.arange(4)).x.numpy()  # (window, value + mask, time, 8, 8)
    np.testing.assert_array_equal(x[0, 0], np.nan_to_num(want[:, :8, :8]))
    stats = dfl.io.normalization_stats(str(packed_store), name)
    assert stats.mean[0] == pytest.approx(np.nanmean(want.astype(np.float64)), rel=1e-9)
    assert stats.count[0] == np.isfinite(want).sum()
    raw = dfl.io.ZarrSource(zarr.open_group(packed_store), x=name, sample_dim=0, shuffle=False)
    assert raw.read(np.arange(2)).x.dtype != batch.x.dtype  # an opened group: as stored


def test_a_store_without_cf_encoding_is_read_from_its_path(tmp_path):
    """dataflow's own stores and xarray's floats (their fill value is NaN) keep the path."""
    x = np.random.default_rng(0).normal(size=(8, 1, 4, 4)).astype(np.float32)
    ours = dfl.io.to_zarr(tmp_path / "ours.zarr", x, np.arange(8))
    assert isinstance(dfl.io.ZarrSource(ours, x="x", y="y").store, os.PathLike)
    xr.Dataset({"f": (("time", "lat"), x[:, 0, 0])}).to_zarr(
        tmp_path / "floats.zarr", consolidated=False
    )
    assert isinstance(dfl.io.ZarrSource(str(tmp_path / "floats.zarr"), x="f").store, str)


def test_a_missing_chunk_of_a_cf_encoded_store_is_named_not_read_as_nan(packed_store):
    os.remove(packed_store / "t" / "c" / "1" / "0" / "1")
    source = dfl.io.ZarrSource(str(packed_store), x="t", sample_dim="time", shuffle=False)
    with pytest.raises(ChunkMissingError, match=r"t/c/1/0/1"):
        source.read(np.arange(20))
