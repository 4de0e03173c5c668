"""xarray data read from zarr is checked for missing chunks as a raw zarr read is.

xarray reads a chunk absent from the store as the array's fill value (NaN for these
floats, 0 for the int16 counts), which a fit would train on. A DataArray that is an
unmodified view of a zarr array, or a box of one (a slice with step 1), is read raw (each
read checks the chunks it decodes), CF-decoded by xarray's own functions where xarray
decodes it; data strided or computed since is checked whole when the source is built. Real
zarr stores on disk, opened lazily by xarray (``chunks=None``) and through dask
(``open_zarr``'s default).
"""

from __future__ import annotations

import os
import pickle
import warnings

import numpy as np
import pytest
import zarr

import dataflow as dfl
from dataflow.core.errors import ChunkMissingError
from dataflow.io.xarray_adapters import zarr_arrays_behind
from dataflow.io.xarray_backing import unmodified_zarr_array

xr = pytest.importorskip("xarray")

OPENED = {"dask": {}, "lazy": None}  # open_dataset's chunks=: a dask graph, or adapters
PATCH = {"lat": 8, "lon": 8}


@pytest.fixture
def store(tmp_path):
    """A zarr store as xarray writes it: a float field and int16 counts over (time, lat,
    lon), chunked (5, 8, 8), and a packed variable (CF ``scale_factor``); its path."""
    rng = np.random.default_rng(0)
    dims = ("time", "lat", "lon")
    dataset = xr.Dataset(
        {
            "t": (dims, rng.random((20, 16, 16), dtype=np.float32)),
            "counts": (dims, rng.integers(1, 5, (20, 16, 16)).astype(np.int16)),
            "packed": (dims, 0.1 + rng.random((20, 16, 16))),  # (never 0 once packed)
        }
    )
    encoding = {name: {"chunks": (5, 8, 8)} for name in dataset.data_vars}
    encoding["packed"].update(dtype="int16", scale_factor=0.001, _FillValue=-1)
    path = tmp_path / "fields.zarr"
    dataset.to_zarr(path, encoding=encoding, consolidated=False)
    return path


def opened(path, how: str):
    return xr.open_dataset(path, engine="zarr", chunks=OPENED[how], consolidated=False)


def lose(path, name: str) -> str:
    """Delete one chunk of array ``name``; its key."""
    key = f"{name}/c/1/0/1"
    os.remove(path / key)
    return key


@pytest.mark.parametrize("how", OPENED)
@pytest.mark.parametrize("name", ["t", "counts"])
def test_a_data_array_straight_from_zarr_is_read_raw_and_a_missing_chunk_is_named(store, how, name):
    ds = opened(store, how)
    array = unmodified_zarr_array(ds[name])
    assert isinstance(array, zarr.Array) and array.path == name
    source = dfl.io.PatchSource(ds[name], patch=PATCH, shuffle=False)
    assert source.store is array or source.store.path == name  # read raw, not via xarray
    via_dataset = dfl.io.PatchSource(ds, name, patch=PATCH, shuffle=False)
    every = np.arange(source.num_samples)
    assert np.array_equal(source.read(every).x.numpy(), via_dataset.read(every).x.numpy())
    travelled = pickle.loads(pickle.dumps(source))  # as a worker gets it
    assert np.array_equal(travelled.read(every).x.numpy(), source.read(every).x.numpy())
    samples = dfl.io.ZarrSource(ds[name], sample_dim="time", shuffle=False)
    assert isinstance(samples.store, zarr.Array)
    by_name = dfl.io.ZarrSource(ds, x=name, sample_dim="time", shuffle=False)
    np.testing.assert_array_equal(
        samples.read(np.arange(20)).x.numpy(), by_name.read(np.arange(20)).x.numpy()
    )
    key = lose(store, name)
    ds = opened(store, how)
    source = dfl.io.PatchSource(ds[name], patch=PATCH, shuffle=False)
    with pytest.raises(ChunkMissingError, match=key):
        source.read(every)
    samples = dfl.io.ZarrSource(ds[name], sample_dim="time", shuffle=False)
    with pytest.raises(ChunkMissingError, match=key):
        samples.read(np.arange(20))


def _sliced_data_array(ds, name):  # (a box: read raw, below and test_patch_splits)
    return dfl.io.PatchSource(ds[name].isel(time=slice(0, 15)), patch=PATCH)


def _sliced_dataset_patches(ds, name):
    return dfl.io.PatchSource(ds.isel(time=slice(0, 15)), name, patch=PATCH)


def _strided_data_array(ds, name):
    return dfl.io.PatchSource(ds[name].isel(time=slice(0, 20, 2)), patch=PATCH)


def _strided_dataset_patches(ds, name):
    return dfl.io.PatchSource(ds.isel(time=slice(0, 20, 2)), name, patch=PATCH)


def _strided_dataset_samples(ds, name):  # (a slice with step 1: read raw, test_xarray_slices)
    return dfl.io.ZarrSource(ds.isel(time=slice(0, 20, 2)), x=name, sample_dim="time")


def _strided_data_array_samples(ds, name):
    return dfl.io.ZarrSource(ds[name].isel(time=slice(0, 20, 2)), sample_dim="time")


def _computed_data_array(ds, name):
    return dfl.io.PatchSource(ds[name] * 2, patch=PATCH)


BUILT = {
    "a strided DataArray (PatchSource)": _strided_data_array,
    "a strided Dataset (PatchSource)": _strided_dataset_patches,
    "a strided Dataset (ZarrSource)": _strided_dataset_samples,
    "a strided DataArray (ZarrSource)": _strided_data_array_samples,
}


@pytest.mark.parametrize("how", OPENED)
@pytest.mark.parametrize("build", BUILT.values(), ids=BUILT)
@pytest.mark.parametrize("name", ["t", "counts", "packed"])
def test_xarray_data_sliced_or_scaled_since_is_checked_when_the_source_is_built(
    store, how, build, name
):
    """Not a box of the stored array (a stride; CF unpacking for ``packed``): read
    through xarray, but only once every chunk it reads exists. Complete, it reads what
    xarray reads; one chunk gone, it is refused naming the chunk and the fill value
    xarray would have given, before anything is read."""
    ds = opened(store, how)
    assert unmodified_zarr_array(ds[name].isel(time=slice(0, 20, 2))) is None
    source = build(ds, name)
    batch = source.read(np.arange(4))
    assert np.isfinite(batch.x.numpy()).all() and (batch.x.numpy() != 0).all()
    key = lose(store, name)
    fill = {"t": "nan", "counts": "0", "packed": "0"}[name]  # (stored, before unpacking)
    with pytest.raises(ChunkMissingError, match=f"the first '{key}'.*fill value \\({fill}\\)"):
        build(opened(store, how), name)


SLICED = {"DataArray": _sliced_data_array, "Dataset": _sliced_dataset_patches}


@pytest.mark.parametrize("how", OPENED)
@pytest.mark.parametrize("build", SLICED.values(), ids=SLICED)
@pytest.mark.parametrize("name", ["t", "counts", "packed"])
def test_windows_of_a_slice_are_read_raw_and_a_missing_chunk_named_at_the_read(
    store, how, build, name
):
    """A slice with step 1: windows of its box read raw (``packed``: each piece of a
    chunk unpacked as xarray unpacks it), so nothing is listed when the source is built
    and a missing chunk is named where a read decodes it."""
    source = build(opened(store, how), name)
    (array,) = source._open()
    assert array.cuts_direct and bool(array.decode) == (name == "packed")
    key = lose(store, name)
    source = build(opened(store, how), name)
    with pytest.raises(ChunkMissingError, match=f"PatchSource.*'{key}'"):
        source.read(np.arange(4))


def test_computed_data_is_checked_through_its_dask_graph(store):
    ds = opened(store, "dask")
    computed = ds["t"] * 2
    assert unmodified_zarr_array(computed) is None
    assert [a.path for a in zarr_arrays_behind(computed)] == ["t"]
    assert unmodified_zarr_array(ds["t"].chunk({"time": 10})) is None  # a rechunk
    _computed_data_array(ds, "t")  # complete: built
    key = lose(store, "t")
    with pytest.raises(ChunkMissingError, match=key):
        _computed_data_array(opened(store, "dask"), "t")


@pytest.mark.parametrize("how", OPENED)
def test_a_packed_variable_is_read_raw_and_unpacked_as_xarray_unpacks_it(store, how):
    """Stored, ``packed`` is int16 counts of 0.001: read raw (chunk-aware, each read
    checked), then unpacked by xarray's own decoding functions, slab by slab, so the
    values are xarray's bit for bit, in its dtype, by either source."""
    ds = opened(store, how)
    assert unmodified_zarr_array(ds["packed"]) is None  # (not its stored values)
    expected = opened(store, how)["packed"].values
    source = dfl.io.PatchSource(ds["packed"], patch=PATCH, shuffle=False)
    (array,) = source._open()
    assert array.reader is not None and array.decode and array.dtype == np.float64
    x = source.read(np.arange(4)).x.numpy()  # (window, channel, time, lat, lon)
    np.testing.assert_array_equal(x[1, 0], expected[:, :8, 8:])
    samples = dfl.io.ZarrSource(ds, x="packed", sample_dim="time", shuffle=False)
    (reader,) = samples._open()
    assert reader.decode and reader.empty().dtype == np.float64
    np.testing.assert_array_equal(samples.read(np.arange(20)).x.numpy(), expected)


@pytest.mark.parametrize("how", OPENED)
def test_a_dataset_whose_variables_changed_since_it_was_opened_reads_the_changed_values(
    store, how, tmp_path
):
    """``ds.assign(t=ds.t * 2)``, a variable of another store under the same name, and
    ``ds.load()`` edited in memory all keep the Dataset's ``encoding["source"]``: each
    source and ``normalization_stats`` read the values the Dataset holds, not the store's
    (they were read raw from the path before: silently the stored values)."""
    ds = opened(store, how)
    other = tmp_path / "other.zarr"
    xr.Dataset({"t": ds["t"] + 10}).to_zarr(other, consolidated=False)
    loaded = opened(store, how).load()
    loaded["t"].values[:] = 3.0
    changed = {
        "assigned": ds.assign(t=ds["t"] * 2),
        "another store's": ds.assign(t=opened(other, how)["t"]),
        "loaded and edited": loaded,
    }
    for why, dataset in changed.items():
        want = dataset["t"].values
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (in memory: cannot be checked, said elsewhere)
            samples = dfl.io.ZarrSource(dataset, x="t", sample_dim="time", shuffle=False)
            windows = dfl.io.PatchSource(dataset, "t", patch=PATCH, shuffle=False)
            stats = dfl.io.normalization_stats(windows)
        np.testing.assert_array_equal(samples.read(np.arange(20)).x.numpy(), want, err_msg=why)
        x = windows.read(np.arange(4)).x.numpy()  # (window, channel, time, lat, lon)
        np.testing.assert_array_equal(x[1, 0], want[:, :8, 8:], err_msg=why)
        assert stats.mean[0] == pytest.approx(want.astype(np.float64).mean(), rel=1e-6), why
    unchanged = dfl.io.ZarrSource(opened(store, how), x="t", sample_dim="time")
    assert isinstance(unchanged.store, str)  # (still read raw from its path)


def test_data_read_from_zarr_into_memory_warns_that_it_cannot_be_checked(store):
    loaded = opened(store, "lazy")["t"].isel(time=slice(0, 15)).load()
    assert zarr_arrays_behind(loaded) == []
    with pytest.warns(RuntimeWarning, match="in memory now.*pass the Dataset"):
        dfl.io.PatchSource(loaded, patch=PATCH)
    in_memory = xr.DataArray(np.ones((4, 8, 8), np.float32), dims=("time", "lat", "lon"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # data never in a store: nothing to say
        dfl.io.PatchSource(in_memory, patch=PATCH)


@pytest.mark.parametrize("build", BUILT.values(), ids=BUILT)
def test_the_store_is_listed_once_on_the_driver_not_again_where_the_source_travels(
    store, build, monkeypatch
):
    from dataflow.io import xarray_backing

    listed = []
    absent_objects = xarray_backing.absent_objects
    monkeypatch.setattr(
        xarray_backing,
        "absent_objects",
        lambda a, box=None: listed.append(a.path) or absent_objects(a, box),
    )
    source = build(opened(store, "dask"), "t")
    assert listed == ["t"]
    travelled = pickle.loads(pickle.dumps(source))  # as a worker gets it
    np.testing.assert_array_equal(
        travelled.read(np.arange(3)).x.numpy(), source.read(np.arange(3)).x.numpy()
    )
    assert listed == ["t"]


def test_cf_masked_variables_are_masked_as_xarray_masks_them(tmp_path):
    """int16 with ``_FillValue=-999`` (xarray: float32, NaN there) and float32 with
    ``_FillValue=1e20`` (NaN there): their stored values would train on -999 and 1e20.
    Read raw, they are masked by xarray's own function, so the masked cells are NaN:
    refused by a PatchSource's ``nan="refuse"``, a zero and a mask channel under
    ``nan="mask"``."""
    field = np.arange(4 * 8 * 8, dtype=np.float32).reshape(4, 8, 8) + 1
    masked = field.astype(np.int16)
    masked[1, 2, 3] = -999
    far = field.copy()
    far[2, 5, 6] = 1e20
    dims = ("time", "lat", "lon")
    dataset = xr.Dataset({"masked": (dims, masked), "far": (dims, far)})
    encoding = {"masked": {"_FillValue": -999}, "far": {"_FillValue": 1e20}}
    dataset.to_zarr(tmp_path / "cf.zarr", encoding=encoding, consolidated=False)
    ds = xr.open_zarr(tmp_path / "cf.zarr", consolidated=False)
    for name, (t, i, j) in {"masked": (1, 2, 3), "far": (2, 5, 6)}.items():
        assert unmodified_zarr_array(ds[name]) is None
        samples = dfl.io.ZarrSource(ds, x=name, sample_dim="time", shuffle=False)
        assert samples._open()[0].decode  # (raw, then masked)
        x = samples.read(np.arange(4)).x.numpy()
        assert np.isnan(x[t, i, j]) and np.isfinite(np.delete(x.ravel(), t * 64 + i * 8 + j)).all()
        with pytest.raises(dfl.DataError, match="holds NaN"):
            dfl.io.PatchSource(ds, name, patch={"time": 1}, shuffle=False).read(np.arange(4))
        windows = dfl.io.PatchSource(ds[name], patch={"time": 1}, nan="mask", shuffle=False)
        x = windows.read(np.arange(4)).x.numpy()  # (window, channel + mask, 1, lat, lon)
        assert x[t, 0, 0, i, j] == 0 and x[t, 1, 0, i, j] == 0 and x[t, 1].sum() == 63


def test_a_dask_array_from_zarr_is_read_raw_and_a_slice_of_it_checked(store):
    """``dask.array.from_zarr``: the zarr array at the graph's root. Unchanged, it is read
    raw; sliced, both sources read its box raw too (each read checked)."""
    import dask.array

    stored = dask.array.from_zarr(str(store), component="counts")
    source = dfl.io.ZarrSource(stored, shuffle=False)
    assert isinstance(source.store, zarr.Array)
    np.testing.assert_array_equal(source.read(np.arange(20)).x.numpy(), stored.compute())
    sliced = dfl.io.PatchSource(stored[:15], patch={1: 8, 2: 8})  # complete: built
    assert sliced.num_samples == 4
    key = lose(store, "counts")
    stored = dask.array.from_zarr(str(store), component="counts")
    with pytest.raises(ChunkMissingError, match=key):
        dfl.io.ZarrSource(stored, shuffle=False).read(np.arange(20))
    with pytest.raises(ChunkMissingError, match=key):
        dfl.io.PatchSource(stored[:15], patch={1: 8, 2: 8}).read(np.arange(4))
    with pytest.raises(ChunkMissingError, match=key):
        dfl.io.ZarrSource(stored[:15], shuffle=False).read(np.arange(15))


def test_to_zarr_refuses_to_copy_a_dataset_missing_a_chunk_into_fill_values(store, tmp_path):
    """Copied, the fill value would be written as data, and the copy complete: the
    check would never see it again."""
    dfl.io.to_zarr(tmp_path / "copy.zarr", opened(store, "dask")[["t"]], sample_dim="time")
    key = lose(store, "t")
    with pytest.raises(ChunkMissingError, match=f"to_zarr\\(dataset='t'\\).*'{key}'"):
        dfl.io.to_zarr(tmp_path / "copy.zarr", opened(store, "dask")[["t"]], sample_dim="time")
