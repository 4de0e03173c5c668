"""Windows of a split made in xarray are read raw: ``PatchSource(ds.isel(lat=slice(5,
45)), ...)`` reads the box of each zarr array the split holds, moved by the box's
origin, so only the chunks the windows touch are decoded and checked; its read units
(blocks) follow the stored chunks' edges, not the split's; a chunk missing outside the
split refuses nothing. Real zarr stores on disk, written by xarray.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_patch_source import precut, seg_pipeline

import dataflow as dfl
from dataflow.core.errors import ChunkMissingError

xr = pytest.importorskip("xarray")

OPENED = {"dask": {}, "lazy": None}  # open_dataset's chunks=: a dask graph, or adapters
GRID = dict(patch={"lat": 8, "lon": 8}, stride={"lat": 5, "lon": 6})
SPLIT = slice(5, 45)  # lat 5..44: stored chunk rows 0-2 of 16 (not on their edges)


@pytest.fixture
def fields(tmp_path):
    """Two 64 x 48 fields ``a``, ``b`` and labels ``lab``, chunked 16 x 16, written by
    xarray (lat has a coordinate); returns the store and the arrays."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 48)).astype(np.float32)
    b = rng.normal(size=(64, 48)).astype(np.float32)
    data = {"a": a, "b": b, "lab": ((a + b) > 0).astype(np.int64) + (a > 1).astype(np.int64)}
    dims = ("lat", "lon")
    dataset = xr.Dataset({k: (dims, v) for k, v in data.items()}, coords={"lat": np.arange(64)})
    path = tmp_path / "fields.zarr"
    dataset.to_zarr(path, encoding={k: {"chunks": (16, 16)} for k in data}, consolidated=False)
    return path, data


def opened(path, how: str):
    return xr.open_dataset(path, engine="zarr", chunks=OPENED[how], consolidated=False)


def split_tiles(path, how: str = "dask", **options):
    part = opened(path, how).isel(lat=SPLIT)
    return dfl.io.PatchSource(part, ["a", "b"], "lab", **{**GRID, **options})


def by_hand(data, source):
    """The split's windows cut from the arrays in memory: x (n, 2, 8, 8) and y."""
    x = np.stack([precut(data[k][SPLIT], source.corners, (8, 8), (0, 1)) for k in "ab"], 1)
    return x, precut(data["lab"][SPLIT], source.corners, (8, 8), (0, 1))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("how", OPENED)
def test_windows_of_a_split_are_read_raw_and_are_the_windows_of_the_split(fields, how, shuffle):
    path, data = fields
    source = split_tiles(path, how, shuffle=shuffle)
    for array in source._open():
        assert array.cuts_direct and array.origin == (5, 0)  # raw, not through xarray
    assert source.num_samples == 7 * 7  # (corners 0, 5, ..., 30 of the 40 rows)
    x, y = by_hand(data, source)
    every = np.arange(source.num_samples)
    batch = source.read(every)
    np.testing.assert_array_equal(batch.x.numpy(), x)
    np.testing.assert_array_equal(batch.y.numpy(), y)
    order = np.random.default_rng(1).permutation(source.num_samples)[:9]
    np.testing.assert_array_equal(source.read(order).x.numpy(), x[order])
    streamed = list(dfl.io.stream_batches(source, 7, seed=2))
    indices = np.concatenate([b.indices for b in streamed])
    assert sorted(indices.tolist()) == every.tolist()  # every window once an epoch
    np.testing.assert_array_equal(np.concatenate([b.x.numpy() for b in streamed]), x[indices])


def test_a_split_s_read_units_follow_the_stored_chunks_edges(fields):
    """Shuffled, a unit is a block of stored chunks: its windows' corners, moved by the
    split's origin, fall in one stored block (not in one block of the split)."""
    path, _ = fields
    source = split_tiles(path, shuffle=True)
    kind, block, _ = source._plan
    assert kind == "block"
    origin = np.asarray([5, 0])
    for members in source.chunk_members:
        stored = (source.corners[members] + origin) // np.asarray(block)
        assert len(np.unique(stored, axis=0)) == 1
    # the first stored block row holds the split's corners 0..10 (lat 5..15 stored)
    first = source.chunk_members[0]
    assert source.corners[first][:, 0].max() < block[0] - 5


def test_a_chunk_missing_outside_the_split_refuses_nothing_one_inside_is_named(fields):
    path, data = fields
    os.remove(path / "a" / "c" / "3" / "1")  # lat 48..63: outside the split
    source = split_tiles(path, shuffle=False)
    x, _ = by_hand(data, source)
    np.testing.assert_array_equal(source.read(np.arange(source.num_samples)).x.numpy(), x)
    os.remove(path / "b" / "c" / "1" / "0")  # lat 16..31, lon 0..15: inside
    source = split_tiles(path, shuffle=False)  # (nothing listed when built)
    units = range(len(source.chunk_members))
    with pytest.raises(ChunkMissingError, match=r"PatchSource.*b/c/1/0"):
        source.check_chunks(units)
    with pytest.raises(ChunkMissingError, match=r"b/c/1/0"):
        source.read(np.arange(source.num_samples))


def test_the_statistics_of_a_split_are_the_split_s_and_kept_apart_from_another(fields, tmp_path):
    path, data = fields
    stats = dfl.io.normalization_stats(split_tiles(path))
    for k, name in enumerate("ab"):
        assert stats.mean[k] == pytest.approx(float(data[name][SPLIT].mean()), rel=1e-6)
        assert stats.std[k] == pytest.approx(float(data[name][SPLIT].std()), rel=1e-5)
    assert stats.count == (40 * 48, 40 * 48)
    kept = tmp_path / "run"
    assert dfl.io.normalization_stats(split_tiles(path), path=kept) == stats
    other = dfl.io.PatchSource(opened(path, "dask").isel(lat=slice(20, 60)), ["a", "b"], **GRID)
    measured = dfl.io.normalization_stats(other, path=kept)  # same shape, another split
    assert measured.fingerprint != stats.fingerprint
    assert measured.mean[0] == pytest.approx(float(data["a"][20:60].mean()), rel=1e-6)


@pytest.mark.slow
def test_a_fit_on_windows_of_a_split_equals_the_fit_on_them_cut_by_hand(client, fields):
    """Unshuffled windows of the split (C order) train as the same windows pre-cut in
    memory; shuffled, every window of the split is trained once an epoch, scored on a
    held-out split read raw as well."""
    path, data = fields
    source = split_tiles(path, shuffle=False)
    x, y = by_hand(data, source)
    cut = seg_pipeline(dfl.io.ArraySource(x, y, shuffle=False)).fit(epochs=2, client=client)
    windows = seg_pipeline(source).fit(epochs=2, client=client)
    for name, tensor in cut.model.state_dict().items():
        assert torch.allclose(windows.model.state_dict()[name], tensor, atol=1e-6), name
    held_out = dfl.io.PatchSource(
        opened(path, "dask").isel(lat=slice(48, 64)), ["a", "b"], "lab", **GRID, shuffle=False
    )
    shuffled = seg_pipeline(split_tiles(path), eval_source=held_out).fit(epochs=2, client=client)
    for epoch in range(2):
        assert shuffled.ledger.consumed(epoch).tolist() == list(range(source.num_samples))
    assert [e["held_out_samples"] for e in shuffled.history.epochs] == [2 * 7] * 2


def test_a_region_of_a_split_s_windows_and_a_planned_chunk_cache_read_the_same_cells(fields):
    """Features that meet a split: a spatial rank's region of each window (decoding
    only the stored chunks that part touches), and a chunk cache smaller than the
    arrays (planned from the epoch's order of units, keyed by stored chunks)."""
    path, data = fields
    source = split_tiles(path, shuffle=True)
    x, y = by_hand(data, source)
    every = np.arange(source.num_samples)
    part = source.region({1: (0, 4), 2: (2, 8)})  # (channels, lat, lon) of each window
    np.testing.assert_array_equal(part.read(every).x.numpy(), x[:, :, 0:4, 2:8])
    cached = split_tiles(path, shuffle=True, chunk_cache_mb=0.004)  # 4 KB: 4 stored chunks
    assert cached.plan_reads([range(len(cached.chunk_members))]) is not None
    streamed = list(dfl.io.stream_batches(cached, 5, seed=4))
    indices = np.concatenate([b.indices for b in streamed])
    assert sorted(indices.tolist()) == every.tolist()
    np.testing.assert_array_equal(np.concatenate([b.x.numpy() for b in streamed]), x[indices])
    np.testing.assert_array_equal(np.concatenate([b.y.numpy() for b in streamed]), y[indices])


@pytest.fixture
def levels(tmp_path):
    """A field on pressure levels: ``t`` (time 6, level 4, lat 32, lon 24) chunked
    (2, 2, 16, 8), written by xarray with a level coordinate."""
    rng = np.random.default_rng(5)
    t = rng.normal(size=(6, 4, 32, 24)).astype(np.float32)
    dataset = xr.Dataset(
        {"t": (("time", "level", "lat", "lon"), t)}, coords={"level": [1000, 850, 500, 250]}
    )
    path = tmp_path / "levels.zarr"
    dataset.to_zarr(path, encoding={"t": {"chunks": (2, 2, 16, 8)}}, consolidated=False)
    return path, t


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("how", OPENED)
def test_windows_of_one_level_are_read_raw_from_the_stored_chunks(levels, how, shuffle):
    """``ds.sel(level=500)`` (an axis at one index, dropped): windows of ``(time, lat,
    lon)`` cut from the stored 4-D chunks of that level; a ZarrSource of it reads its
    samples raw too (``test_xarray_slices.py``), the same values."""
    path, t = levels
    part = opened(path, how).sel(level=500).isel(lat=slice(3, 29))
    patch = {"time": 2, "lat": 8, "lon": 8}
    source = dfl.io.PatchSource(part, "t", patch=patch, shuffle=shuffle)
    (array,) = source._open()
    assert array.cuts_direct and array.where == (0, 2, 3, 0) and array.origin == (0, 3, 0)
    assert str(source.store).endswith("t[level 2, lat 3:29]")
    field = t[:, 2, 3:29]
    every = np.arange(source.num_samples)
    want = precut(field, source.corners, (2, 8, 8), (0, 1, 2))
    np.testing.assert_array_equal(source.read(every).x.numpy()[:, 0], want)
    streamed = list(dfl.io.stream_batches(source, 5, seed=1))
    indices = np.concatenate([b.indices for b in streamed])
    assert sorted(indices.tolist()) == every.tolist()
    np.testing.assert_array_equal(
        np.concatenate([b.x.numpy() for b in streamed])[:, 0], want[indices]
    )
    samples = dfl.io.ZarrSource(part, x="t", sample_dim="time", shuffle=False)
    np.testing.assert_array_equal(samples.read(np.arange(6)).x.numpy(), field)
    stats = dfl.io.normalization_stats(source)
    other = dfl.io.normalization_stats(
        dfl.io.PatchSource(
            opened(path, how).sel(level=850).isel(lat=slice(3, 29)), "t", patch=patch
        )
    )
    assert stats.mean[0] == pytest.approx(float(field.mean()), rel=1e-5)
    assert other.mean[0] == pytest.approx(float(t[:, 1, 3:29].mean()), rel=1e-5)
    assert other.fingerprint != stats.fingerprint


def test_a_level_s_chunk_cache_counts_the_stored_chunks_it_decodes(levels):
    """One level of four, chunked two levels a chunk: its stored chunks decode twice its
    own bytes, so a cache that holds the level but not its chunks plans the epoch."""
    path, _ = levels
    part = opened(path, "dask").sel(level=500)
    patch = {"time": 2, "lat": 8, "lon": 8}
    (array,) = dfl.io.PatchSource(part, "t", patch=patch)._open()
    own = 6 * 32 * 24 * 4
    assert array.decoded_bytes == 2 * own
    between = 1.5 * own / 2**20
    source = dfl.io.PatchSource(part, "t", patch=patch, chunk_cache_mb=between)
    assert source.plan_reads([range(len(source.chunk_members))]) is not None
    whole = dfl.io.PatchSource(part, "t", patch=patch, chunk_cache_mb=3 * own / 2**20)
    assert whole.plan_reads([range(len(whole.chunk_members))]) is None  # kept across epochs


@pytest.mark.parametrize("how", OPENED)
def test_one_level_of_a_packed_field_split_reads_as_xarray_reads_it(tmp_path, how):
    """Every trace at once: a split in time, one level, CF-packed int16 with a fill
    value: both sources read it raw and give xarray's values (NaN where masked)."""
    rng = np.random.default_rng(8)
    field = rng.normal(size=(10, 3, 16, 16))
    field[4, 1, 5, 5] = np.nan
    encoding = {"chunks": (2, 2, 8, 8), "dtype": "int16", "scale_factor": 0.01, "_FillValue": -9999}
    xr.Dataset({"t": (("time", "level", "lat", "lon"), field)}).to_zarr(
        tmp_path / "packed.zarr", encoding={"t": encoding}, consolidated=False
    )

    def split(ds):
        return ds.isel(time=slice(1, 9), level=1)

    want = split(opened(tmp_path / "packed.zarr", how))["t"].values
    samples = dfl.io.ZarrSource(
        split(opened(tmp_path / "packed.zarr", how)), x="t", sample_dim="time", shuffle=False
    )
    (reader,) = samples._open()
    assert reader.dropped == (1,) and reader.decode
    np.testing.assert_array_equal(samples.read(np.arange(8)).x.numpy(), want)
    windows = dfl.io.PatchSource(
        split(opened(tmp_path / "packed.zarr", how)),
        "t",
        patch={"lat": 8, "lon": 8},
        shuffle=False,
        nan="mask",
    )
    (array,) = windows._open()
    assert array.decode and array.where == (1, 1, 0, 0)
    x = windows.read(np.arange(4)).x.numpy()  # (window, value + mask, time, 8, 8)
    masked = np.nan_to_num(want)
    np.testing.assert_array_equal(x[0, 0], masked[:, :8, :8])
    np.testing.assert_array_equal(x[3, 0], masked[:, 8:, 8:])
    assert x[0, 1, 3, 5, 5] == 0 and np.isnan(want[3, 5, 5])  # (time 4 is the split's 3)


@pytest.mark.parametrize("how", OPENED)
def test_unsigned_bytes_stored_as_signed_are_windowed_raw_as_xarray_reads_them(tmp_path, how):
    """netCDF's ``_Unsigned`` (a satellite product's bytes 0-255 kept as int8, 255 a fill
    value): the windows of a split are cut from the stored chunks, cast to unsigned and
    masked as xarray does, NaN read as 0 with the mask channel."""
    rng = np.random.default_rng(9)
    field = rng.integers(0, 255, (6, 16, 16)).astype(np.uint8)
    field[2, 3, 3] = 255
    encoding = {"chunks": (2, 8, 8), "dtype": "int8", "_Unsigned": "true", "_FillValue": -1}
    xr.Dataset({"b": (("time", "lat", "lon"), field)}).to_zarr(
        tmp_path / "bytes.zarr", encoding={"b": encoding}, consolidated=False
    )
    want = opened(tmp_path / "bytes.zarr", how).isel(time=slice(1, 5))["b"].values
    split = opened(tmp_path / "bytes.zarr", how).isel(time=slice(1, 5))  # (not loaded)
    assert want.dtype == np.float32 and np.nanmax(want) > 127 and np.isnan(want[1, 3, 3])
    windows = dfl.io.PatchSource(split, "b", patch={"lat": 8, "lon": 8}, shuffle=False, nan="mask")
    (array,) = windows._open()
    assert array.decode  # read raw, decoded piece by piece
    x = windows.read(np.arange(4)).x.numpy()  # (window, value + mask, time, 8, 8)
    np.testing.assert_array_equal(x[0, 0], np.nan_to_num(want[:, :8, :8]))
    np.testing.assert_array_equal(x[3, 0], want[:, 8:, 8:])
    assert x[0, 1, 1, 3, 3] == 0 and x[0, 1].sum() == 4 * 64 - 1
