"""A split made in xarray is read raw: ``ZarrSource(ds.sel(time=slice(...)), ...)``.

The box a sliced variable reads is traced back to its zarr array, through xarray's
lazy indexing key (``chunks=None``) or task by task through dask's graph
(``open_zarr``'s default); the source then reads that box of the array raw, so only
the chunks it touches are fetched and checked: a chunk missing outside the slice
refuses nothing, one inside is named at the read. Anything not a box (a step, an
integer index, a transpose, arithmetic, CF unpacking) is read through xarray and
checked whole, as before. Real zarr stores on disk, as xarray writes them.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

import dataflow as dfl
from dataflow.core.errors import ChunkMissingError
from dataflow.io.array_readers import ZarrArrayReader
from dataflow.io.xarray_slices import zarr_box

xr = pytest.importorskip("xarray")

OPENED = {"dask": {}, "lazy": None}  # open_dataset's chunks=: a dask graph, or adapters


@pytest.fixture
def store(tmp_path):
    """(time 20, lat 16, lon 16) fields chunked (5, 8, 8): a float field ``t``, int16
    ``counts``, a CF-packed ``packed``, unsigned bytes stored as signed ``unsigned``
    (netCDF's ``_Unsigned``, 255 masked), and a per-time label ``label`` chunked 5; time
    has a coordinate (days), so ``sel`` slices by label."""
    rng = np.random.default_rng(0)
    dims = ("time", "lat", "lon")
    dataset = xr.Dataset(
        {
            "t": (dims, rng.random((20, 16, 16), dtype=np.float32) + 1),
            "counts": (dims, rng.integers(1, 5, (20, 16, 16)).astype(np.int16)),
            "packed": (dims, 0.1 + rng.random((20, 16, 16))),
            "unsigned": (dims, rng.integers(0, 256, (20, 16, 16)).astype(np.uint8)),
            "label": (("time",), np.arange(20, dtype=np.float32) + 1),
        },
        coords={"time": np.arange(100, 120)},
    )
    encoding = {name: {"chunks": (5, 8, 8)} for name in ("t", "counts", "packed", "unsigned")}
    encoding["packed"].update(dtype="int16", scale_factor=0.001, _FillValue=-1)
    encoding["unsigned"].update(dtype="int8", _Unsigned="true", _FillValue=-1)
    encoding["label"] = {"chunks": (5,)}
    path = tmp_path / "fields.zarr"
    dataset.to_zarr(path, encoding=encoding, consolidated=False)
    return path


def opened(path, how: str):
    return xr.open_dataset(path, engine="zarr", chunks=OPENED[how], consolidated=False)


def readers(source):
    return source._open()


@pytest.mark.parametrize("how", OPENED)
def test_the_box_a_slice_reads_is_traced_to_the_zarr_array(store, how):
    ds = opened(store, how)
    box = zarr_box(ds["t"].isel(time=slice(3, 17)))
    assert box.array.path == "t" and (box.lo, box.hi) == ((3, 0, 0), (17, 16, 16))
    assert box.dims == ("time", "lat", "lon") and not box.whole
    box = zarr_box(ds["t"].sel(time=slice(104, 111)).isel(lat=slice(2, 11)))  # by label
    assert (box.lo, box.hi) == ((4, 2, 0), (12, 11, 16))
    box = zarr_box(ds["t"].isel(time=slice(2, 18)).isel(time=slice(1, 9)))  # twice
    assert (box.lo, box.hi) == ((3, 0, 0), (11, 16, 16))
    assert zarr_box(ds["t"]).whole and zarr_box(ds["label"][5:10]).lo == (5,)
    box = zarr_box(ds["t"].isel(lat=3).isel(time=slice(2, 9)))  # an axis at one index
    assert (box.lo, box.hi, box.dropped) == ((2, 3, 0), (9, 4, 16), (1,))
    assert box.shape == (7, 16) and box.dims == ("time", "lon") and not box.whole
    box = zarr_box(ds["t"].isel(time=slice(4, 12)).isel(time=-1, lon=slice(8, 16)))
    assert (box.lo, box.hi, box.dropped, box.shape) == ((11, 0, 8), (12, 16, 16), (0,), (16, 8))
    box = zarr_box(ds["packed"].isel(time=slice(0, 10)))  # CF-packed: unpacked as xarray does
    assert box.decode and not box.whole and box.dtype == np.float64
    box = zarr_box(ds["unsigned"].isel(time=slice(0, 10)))  # _Unsigned: cast, then masked
    assert len(box.decode) == 2 and box.dtype == np.float32 and box.array.dtype == np.int8
    not_boxes = {
        "a step": ds["t"].isel(time=slice(0, 20, 2)),
        "a transpose": ds["t"].transpose("lon", "lat", "time"),
        "arithmetic": ds["t"].isel(time=slice(0, 10)) * 2,
        "an index array": ds["t"].isel(time=[3, 1, 2]),
        "a reversal": ds["t"].isel(time=slice(None, None, -1)),
    }
    for why, value in not_boxes.items():
        assert zarr_box(value) is None, why


@pytest.mark.parametrize("chunks", [{}, {"time": 10}, {"time": 15, "lat": 16}])
def test_the_read_layer_s_blocks_are_known_without_building_it_and_trace_the_same(
    store, chunks, monkeypatch
):
    """``from_array``'s read layer (a ``Blockwise``) gives each block's slices without
    building its tasks; traced task by task instead, every box is the same."""
    from dataflow.io import xarray_slices

    ds = xr.open_dataset(store, engine="zarr", chunks=chunks, consolidated=False)
    parts = [
        ds["t"],
        ds["t"].isel(time=slice(3, 17)),
        ds["t"].isel(time=slice(6, 19), lat=slice(3, 14)),
        ds["counts"][5:10],
        ds["t"].isel(time=slice(0, 20, 2)),
    ]
    found = [zarr_box(part) for part in parts]
    layers = ds["t"].data.__dask_graph__().layers
    original = next(name for name in layers if str(name).startswith("original-"))
    assert any(xarray_slices._read_slices(layer, original) is not None for layer in layers.values())
    monkeypatch.setattr(xarray_slices, "_read_slices", lambda layer, original: None)
    assert [zarr_box(part) for part in parts] == found
    assert [None if f is None else (f.lo, f.hi) for f in found] == [
        ((0, 0, 0), (20, 16, 16)),
        ((3, 0, 0), (17, 16, 16)),
        ((6, 3, 0), (19, 14, 16)),
        ((5, 0, 0), (10, 16, 16)),
        None,
    ]


def test_a_rechunked_slice_is_not_a_box(store):
    ds = opened(store, "dask")
    assert zarr_box(ds["t"].isel(time=slice(3, 17)).chunk({"time": 7})) is None


@pytest.mark.parametrize("how", OPENED)
@pytest.mark.parametrize("name", ["t", "counts", "packed", "unsigned"])
def test_a_sliced_dataset_is_read_raw_and_reads_what_xarray_reads(store, how, name):
    ds = opened(store, how)
    part = ds.sel(time=slice(103, 116))  # samples 3..16: chunk edges at 5, 10, 15
    source = dfl.io.ZarrSource(part, x=name, y="label", sample_dim="time", shuffle=False)
    assert all(isinstance(r, ZarrArrayReader) for r in readers(source))
    assert source.num_samples == 14
    np.testing.assert_array_equal(source.chunk_bounds, [0, 2, 7, 12, 14])
    every = np.arange(14)
    batch = source.read(every)
    np.testing.assert_array_equal(batch.x.numpy(), part[name].values)
    np.testing.assert_array_equal(batch.y.numpy(), part["label"].values)
    shuffled = np.random.default_rng(1).permutation(14)
    np.testing.assert_array_equal(source.read(shuffled).x.numpy(), part[name].values[shuffled])
    travelled = pickle.loads(pickle.dumps(source))  # as a worker gets it
    np.testing.assert_array_equal(travelled.read(every).x.numpy(), batch.x.numpy())
    single = dfl.io.ZarrSource(ds[name][3:17], sample_dim="time", shuffle=False)  # a DataArray
    assert isinstance(readers(single)[0], ZarrArrayReader)
    np.testing.assert_array_equal(single.read(every).x.numpy(), batch.x.numpy())


@pytest.mark.parametrize("kind", ["ZarrSource", "PatchSource"])
def test_a_split_is_traced_once_where_built_and_travels_as_its_boxes(store, kind, monkeypatch):
    """The driver traces each variable's dask graph once; the source holds the arrays'
    boxes (not the Dataset: no dask graph pickled), so a worker's copy opens without
    tracing anything, and its repr names the boxes."""
    from dataflow.io import xarray_slices

    traced = []
    trace = xarray_slices._dask_box
    monkeypatch.setattr(xarray_slices, "_dask_box", lambda d: traced.append(d.name) or trace(d))
    part = opened(store, "dask").isel(time=slice(3, 17), lat=slice(0, 8))
    if kind == "ZarrSource":
        source = dfl.io.ZarrSource(part, x="t", y="label", sample_dim="time", shuffle=False)
    else:
        source = dfl.io.PatchSource(part, "t", patch={"lat": 4, "lon": 8}, shuffle=False)
    assert len(traced) == (2 if kind == "ZarrSource" else 1)  # (t and label, once each)
    assert isinstance(source.store, xarray_slices.ZarrSplit)
    assert f"split of 'file://{store}': t[time 3:17, lat 0:8]" in repr(source)
    every = np.arange(source.num_samples)
    want = source.read(every).x.numpy()
    blob = pickle.dumps(source)
    assert b"dask" not in blob and len(blob) < 20_000, len(blob)
    monkeypatch.setattr(xarray_slices, "_dask_box", None)  # a worker: nothing to trace
    travelled = pickle.loads(blob)
    np.testing.assert_array_equal(travelled.read(every).x.numpy(), want)


@pytest.mark.parametrize("how", OPENED)
def test_a_slice_across_the_sample_and_a_region_of_it_read_only_their_box(store, how):
    """Sliced along lat too, and a region of that: the region's coordinates are the
    slice's, and the array read is the box inside the box."""
    ds = opened(store, how)
    part = ds.isel(time=slice(6, 19), lat=slice(3, 14))
    source = dfl.io.ZarrSource(part, x="t", sample_dim="time", shuffle=False)
    assert source.sample_shape == (11, 16)
    np.testing.assert_array_equal(source.read(np.arange(13)).x.numpy(), part["t"].values)
    region = source.region({0: (2, 9), 1: (4, 12)})
    np.testing.assert_array_equal(
        region.read(np.arange(13)).x.numpy(), part["t"].values[:, 2:9, 4:12]
    )


@pytest.mark.parametrize("how", OPENED)
def test_a_chunk_missing_outside_the_slice_refuses_nothing_and_one_inside_is_named(store, how):
    os.remove(store / "t" / "c" / "3" / "0" / "1")  # samples 15..19: outside 3..14
    part = opened(store, how).isel(time=slice(3, 15))
    source = dfl.io.ZarrSource(part, x="t", y="label", sample_dim="time", shuffle=False)
    np.testing.assert_array_equal(source.read(np.arange(12)).x.numpy(), part["t"].values)
    os.remove(store / "t" / "c" / "1" / "1" / "0")  # samples 5..9, inside
    source = dfl.io.ZarrSource(
        opened(store, how).isel(time=slice(3, 15)), x="t", sample_dim="time", shuffle=False
    )  # built: only the chunks a read decodes are checked, at the read
    source.read(np.arange(2))  # samples 3, 4: chunk 0
    with pytest.raises(ChunkMissingError, match="t/c/1/1/0"):
        source.read(np.arange(12))
    with pytest.raises(ChunkMissingError, match="t/c/1/1/0"):
        source.check_chunks([1])  # (view chunk 1: samples 5..9)
    source.check_chunks([0, 2])


def test_a_dask_array_from_zarr_sliced_is_read_raw(store):
    import dask.array

    stored = dask.array.from_zarr(str(store), component="counts")
    source = dfl.io.ZarrSource(stored[4:13, 8:], shuffle=False)
    assert isinstance(readers(source)[0], ZarrArrayReader)
    np.testing.assert_array_equal(source.read(np.arange(9)).x.numpy(), stored[4:13, 8:].compute())


@pytest.mark.parametrize("how", OPENED)
def test_a_patch_source_or_a_copy_of_a_slice_checks_only_the_chunks_the_slice_reads(
    store, how, tmp_path
):
    """Read raw (PatchSource: windows of the box, ``tests/test_patch_splits.py``) or
    copied through xarray (to_zarr: checked when built, the box's chunks only), a chunk
    missing outside the slice refuses nothing; one inside is named."""
    os.remove(store / "t" / "c" / "3" / "0" / "1")  # samples 15..19
    part = opened(store, how).isel(time=slice(0, 15))
    patches = dfl.io.PatchSource(part, "t", patch={"lat": 8, "lon": 8}, shuffle=False)
    first = patches.read(np.arange(4)).x.numpy()[0, 0]  # (window, channel, time, lat, lon)
    np.testing.assert_array_equal(first, part["t"].values[:, :8, :8])
    part = opened(store, how).isel(time=slice(0, 15))  # (the read above cached the values)
    copied = dfl.io.to_zarr(tmp_path / "copy.zarr", part[["t", "label"]], sample_dim="time")
    np.testing.assert_array_equal(
        xr.open_zarr(copied, consolidated=False)["t"].values, part["t"].values
    )
    part = opened(store, how).isel(time=slice(0, 16))
    with pytest.raises(ChunkMissingError, match=r"1 of the 16 chunks the slice reads.*t/c/3/0/1"):
        dfl.io.to_zarr(tmp_path / "copy2.zarr", part[["t", "label"]], sample_dim="time")
    patches = dfl.io.PatchSource(part, "t", patch={"lat": 8}, shuffle=False)
    with pytest.raises(ChunkMissingError, match=r"PatchSource.*t/c/3/0/1"):
        patches.read(np.arange(2))


@pytest.mark.slow
def test_a_fit_on_a_split_made_in_xarray_trains_and_scores_exactly_that_split(client, tmp_path):
    """Train on ``sel(sample=slice(16, 63))``, score on the samples before it: the
    model equals one process's training on exactly those samples (the slice starts on
    a chunk edge, so the chunk-aware shuffle sees the chunks a store of them has), every
    sample of the slice is trained once an epoch, and a chunk missing outside both
    slices refuses nothing."""
    import torch.nn.functional as F
    from conftest import TinyCNN, make_data, max_abs_diff, reference_training, sgd

    x, y = make_data(64)
    dataset = xr.Dataset(
        {"x": (("sample", "c", "h", "w"), x), "y": (("sample",), y)},
        coords={"sample": np.arange(64)},
    )
    encoding = {"x": {"chunks": (8, 1, 8, 8)}, "y": {"chunks": (8,)}}
    dataset.to_zarr(tmp_path / "all.zarr", encoding=encoding, consolidated=False)
    ds = xr.open_zarr(tmp_path / "all.zarr", consolidated=False)
    train = ds.sel(sample=slice(16, 63))
    held_out = ds.isel(sample=slice(0, 16))
    pipe = dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=F.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ZarrSource(train, x="x", y="y", sample_dim="sample"),
        eval_source=dfl.io.ZarrSource(held_out, x="x", y="y", sample_dim="sample", shuffle=False),
        schedule=dfl.schedule.Fixed(16),
        progress=False,
    )
    result = pipe.fit(epochs=2, client=client)
    batches = pipe.sample_plan(epochs=2, replicas=2)
    expected = reference_training(x[16:], y[16:], batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-5
    for epoch in range(2):
        assert result.ledger.consumed(epoch).tolist() == list(range(48))
    assert all(np.isfinite(e["eval_loss"]) for e in result.history.epochs)


@pytest.mark.parametrize("layout", ["zarr v2", "sharded"])
def test_a_split_of_a_v2_or_a_sharded_store_is_read_raw_too(tmp_path, layout):
    """zarr format 2, and shards of 4 chunks (which the engine leaves to zarr's own
    read): the box is read from where it starts, its edges the stored objects'."""
    rng = np.random.default_rng(3)
    field = rng.random((24, 8, 8), dtype=np.float32)
    dataset = xr.Dataset({"t": (("time", "lat", "lon"), field)})
    if layout == "zarr v2":
        options = dict(zarr_format=2, encoding={"t": {"chunks": (8, 8, 8)}})
    else:
        options = dict(encoding={"t": {"chunks": (2, 8, 8), "shards": (8, 8, 8)}})
    dataset.to_zarr(tmp_path / "f.zarr", consolidated=False, **options)
    part = xr.open_zarr(tmp_path / "f.zarr", consolidated=False).isel(time=slice(5, 21))
    source = dfl.io.ZarrSource(part, x="t", sample_dim="time", shuffle=False)
    (reader,) = readers(source)
    assert isinstance(reader, ZarrArrayReader)
    assert (reader.decoder is None) == (layout == "sharded")  # (zarr's own read)
    np.testing.assert_array_equal(source.chunk_bounds, [0, 3, 11, 16])  # (shard: 8 steps)
    np.testing.assert_array_equal(source.read(np.arange(16)).x.numpy(), field[5:21])
    np.testing.assert_array_equal(source.read(np.array([15, 0, 7])).x.numpy(), field[[20, 5, 12]])


@pytest.mark.parametrize("how", OPENED)
def test_samples_of_one_level_are_read_raw_and_a_missing_chunk_of_another_refuses_nothing(
    tmp_path, how
):
    """``ds.sel(level=500)``: the level axis is taken at one index, read as stored and
    left out of every sample (shuffled reads, a region, the sample axis not first);
    a chunk missing at another level refuses nothing, one of this level is named."""
    rng = np.random.default_rng(2)
    t = rng.normal(size=(12, 4, 16, 12)).astype(np.float32)
    labels = rng.integers(0, 3, 12)
    dataset = xr.Dataset(
        {"t": (("time", "level", "lat", "lon"), t), "y": (("time",), labels)},
        coords={"level": [1000, 850, 500, 250]},
    )
    path = tmp_path / "levels.zarr"
    dataset.to_zarr(path, encoding={"t": {"chunks": (4, 2, 8, 8)}}, consolidated=False)
    os.remove(path / "t" / "c" / "1" / "0" / "0" / "0")  # levels 1000 and 850
    part = opened(path, how).sel(level=500)
    source = dfl.io.ZarrSource(part, x="t", y="y", sample_dim="time", shuffle=False)
    (reader, _) = readers(source)
    assert isinstance(reader, ZarrArrayReader) and reader.dropped == (1,)
    assert source.sample_shape == (16, 12) and "t[level 2], y" in repr(source)
    order = np.random.default_rng(3).permutation(12)
    batch = source.read(order)
    np.testing.assert_array_equal(batch.x.numpy(), t[order, 2])
    np.testing.assert_array_equal(batch.y.numpy(), labels[order])
    region = source.region({0: (3, 11), 1: (2, 9)})
    np.testing.assert_array_equal(region.read(np.arange(12)).x.numpy(), t[:, 2, 3:11, 2:9])
    across = dfl.io.ZarrSource(part, x="t", sample_dim="lat", shuffle=False)
    np.testing.assert_array_equal(across.read(np.arange(16)).x.numpy(), t[:, 2].transpose(1, 0, 2))
    os.remove(path / "t" / "c" / "2" / "1" / "1" / "1")  # levels 500 and 250, samples 8..11
    source = dfl.io.ZarrSource(
        opened(path, how).sel(level=500), x="t", y="y", sample_dim="time", shuffle=False
    )
    np.testing.assert_array_equal(source.read(np.arange(8)).x.numpy(), t[:8, 2])
    with pytest.raises(ChunkMissingError, match="t/c/2/1/1/1"):
        source.read(np.arange(12))


def test_a_dataset_merged_from_two_stores_is_read_raw_from_each(tmp_path):
    """Variables kept in stores of their own (one per variable, as reanalyses often
    are), merged in xarray and split: each is read raw from its own store."""
    rng = np.random.default_rng(4)
    t = rng.normal(size=(20, 8, 8)).astype(np.float32)
    z = rng.normal(size=(20, 8, 8)).astype(np.float32)
    dims = ("time", "lat", "lon")
    for name, field in (("t", t), ("z", z)):
        xr.Dataset({name: (dims, field)}).to_zarr(
            tmp_path / f"{name}.zarr", encoding={name: {"chunks": (5, 8, 8)}}, consolidated=False
        )
    merged = xr.merge([opened(tmp_path / f"{name}.zarr", "dask") for name in ("t", "z")])
    source = dfl.io.ZarrSource(
        merged.isel(time=slice(2, 18)), x=["t", "z"], sample_dim="time", shuffle=False
    )
    assert all(isinstance(r, ZarrArrayReader) for r in readers(source))
    assert "t.zarr" in repr(source) and "z.zarr" in repr(source)
    x_t, x_z = source.read(np.arange(16)).x  # (one input per array)
    np.testing.assert_array_equal(x_t.numpy(), t[2:18])
    np.testing.assert_array_equal(x_z.numpy(), z[2:18])


def test_whole_chunk_batches_of_a_packed_variable_are_unpacked_as_xarray_unpacks_them(tmp_path):
    """One sample a chunk (a batch of whole chunks, decoded straight into the batch's
    buffer when stored values are read as they are): a packed variable is decoded into a
    slab of its own, then unpacked into the batch, a masked cell NaN as in xarray."""
    from dataflow.io.chunk_reader import EpochChunkReader

    rng = np.random.default_rng(6)
    field = 0.1 + rng.random((12, 16, 16))
    field[3, 2, 2] = np.nan
    encoding = {"chunks": (1, 16, 16), "dtype": "int16", "scale_factor": 0.001, "_FillValue": -1}
    xr.Dataset({"p": (("time", "lat", "lon"), field)}).to_zarr(
        tmp_path / "p.zarr", encoding={"p": encoding}, consolidated=False
    )
    want = opened(tmp_path / "p.zarr", "dask")["p"].values
    source = dfl.io.ZarrSource(
        opened(tmp_path / "p.zarr", "dask"), x="p", sample_dim="time", shuffle=False
    )
    batches = [np.arange(i, i + 4) for i in range(0, 12, 4)]
    got = [b.x.numpy() for b in EpochChunkReader(source, batches, decode_threads=2)]
    np.testing.assert_array_equal(np.concatenate(got), want)
    assert np.isnan(want[3, 2, 2]) and got[0].dtype == want.dtype
