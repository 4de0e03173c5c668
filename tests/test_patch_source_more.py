"""PatchSource beyond its windows: the gather that cuts them, object stores, resume,
NaN, normalisation."""

from __future__ import annotations

import itertools
import pickle
from typing import ClassVar

import numpy as np
import pytest
import torch
import zarr
from test_patch_source import seg_pipeline, tiles, write_2d

import dataflow as dfl
from dataflow.checkpoint import CheckpointStore
from dataflow.io.sharding import shard_epoch
from dataflow.io.windows import box_chunks, cut_windows


def sliced(region, lo, corners, extent, axes) -> np.ndarray:
    """The windows cut one by one with slicing (what ``cut_windows`` must equal)."""
    out = []
    for corner in corners:
        index = [slice(None)] * region.ndim
        for c, e, axis in zip(corner, extent, axes, strict=True):
            index[axis] = slice(c - lo[axis], c - lo[axis] + e)
        out.append(region[tuple(index)])
    return np.stack(out)


@pytest.mark.parametrize(
    ("shape", "extent", "axes"),
    [
        ((30, 20), (4, 5), (0, 1)),
        ((3, 30, 20), (4, 5), (1, 2)),  # a whole leading axis (levels)
        ((30, 3, 20, 2), (6, 5), (0, 2)),  # whole axes between and after the cut ones
        ((12, 10, 9), (3, 3, 3), (0, 1, 2)),
        ((50,), (1,), (0,)),
    ],
)
def test_windows_are_cut_in_one_gather_exactly_as_slicing_cuts_them(shape, extent, axes):
    rng = np.random.default_rng(len(shape))
    region = rng.normal(size=shape).astype(np.float32)
    lo = [0] * len(shape)
    for axis in axes:
        lo[axis] = 7  # the box was read from corner 7 of the array
    high = [shape[a] - e + 7 for a, e in zip(axes, extent, strict=True)]
    corners = np.stack([rng.integers(7, h + 1, 40) for h in high], axis=1)
    got = cut_windows(region, lo, corners, extent, axes)
    assert got.flags.c_contiguous and got.flags.writeable
    assert np.array_equal(got, sliced(region, lo, corners, extent, axes))
    # a strided region (a numpy or dask array's box may not be contiguous)
    odd = np.asfortranarray(region)
    assert np.array_equal(cut_windows(odd, lo, corners, extent, axes), got)


# -- object stores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    from object_store import s3_server

    pytest.importorskip("moto")
    with s3_server() as server:
        yield server


def streamed(source, **options) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [
        (b.indices.copy(), b.x.numpy().copy(), b.y.numpy().copy())
        for b in dfl.io.stream_batches(source, 9, seed=5, **options)
    ]


def test_windows_of_an_s3_store_are_the_local_windows_with_chunk_gets_in_flight_together(
    s3, tmp_path
):
    from object_store import KEY, SECRET

    path, _ = write_2d(tmp_path)
    url = s3.upload(path, "field.zarr")
    grid = dict(patch={"lat": 8, "lon": 8}, stride={"lat": 5, "lon": 6})
    remote = dfl.io.PatchSource(
        url, ["a", "b"], "lab", storage_options=s3.storage_options, block=2, **grid
    )
    local = dfl.io.PatchSource(path, ["a", "b"], "lab", block=2, **grid)
    assert len(remote.chunk_members) > 4  # several units, so several GETs to overlap
    # A box's read fetches its objects together; more at once means the epoch's objects
    # were fetched ahead: the first chunk GET waits (at the proxy) for that many more
    per_box = max(
        len(box_chunks(lo, hi, (16, 16)))
        for unit in remote.chunk_members
        for lo, hi in remote._boxes(unit)
    )
    s3.proxy.reset_counts()
    s3.proxy.delay, s3.proxy.rendezvous = 0.01, per_box + 1
    try:
        got = streamed(remote, decode_threads=1)  # one decode thread: fetches overlap anyway
    finally:
        s3.proxy.delay, s3.proxy.rendezvous = 0.0, 1
    want = streamed(local, decode_threads=1)
    assert len(got) == len(want) > 4
    for (gi, gx, gy), (wi, wx, wy) in zip(got, want, strict=True):
        assert np.array_equal(gi, wi) and np.array_equal(gx, wx) and np.array_equal(gy, wy)
    assert s3.proxy.peak_chunk_gets > per_box, s3.proxy.methods  # the epoch was fetched ahead
    # a worker's copy reads the arrays opened here; no credential shows anywhere
    again = pickle.loads(pickle.dumps(remote))
    assert np.array_equal(again.read(np.arange(3)).x.numpy(), local.read(np.arange(3)).x.numpy())
    shown = [repr(remote), repr(remote.storage_options), repr(remote.__getstate__())]
    assert not [text for text in shown if SECRET in text or KEY in text]
    with pytest.raises(dfl.ConfigError, match=r"fetch_ahead_mb=0.*number > 0"):
        dfl.io.PatchSource(path, "a", patch={"lat": 8}, fetch_ahead_mb=0)


# -- resume ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_shuffled_fit_resumed_from_a_mid_epoch_checkpoint_ends_bit_identical(client, tmp_path):
    path, _ = write_2d(tmp_path)
    source = tiles(path, block=2)
    run = tmp_path / "run"
    options = dict(checkpoint_dir=run, keep_checkpoints=100)
    full = seg_pipeline(source, window_steps=2).fit(2, client=client, checkpoint_every=1, **options)
    mid = [c for c in full.history.info["checkpoints"] if c["mid_phase"]]
    steps_per_epoch = len(full.history.steps) // 2
    point = next(c for c in mid if steps_per_epoch < c["step"] < 2 * steps_per_epoch - 1)
    store = CheckpointStore(run, keep=100)
    for newer in [p for p in store.checkpoints() if p.name > store.path(point["step"]).name]:
        newer.unlink()  # as if the run died just after that checkpoint
        CheckpointStore.manifest_path(newer).unlink()
    resumed = seg_pipeline(source, window_steps=2).fit(2, client=client, resume=True, **options)
    assert resumed.history.info["resumed_from"]["step"] == point["step"]
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    assert [s["loss"] for s in resumed.history.steps] == [s["loss"] for s in full.history.steps]
    for epoch in range(2):
        assert resumed.ledger.consumed(epoch).tolist() == list(range(source.num_samples))


# -- NaN -----------------------------------------------------------------------------------


def nan_field(tmp_path):
    """``a`` and ``b`` 32 x 24 in 16 x 8 chunks, ``a`` NaN at (13, 9) and (20, 3); ``t`` a
    float target, NaN at (30, 22); ``f`` written over its first 10 rows only (fill: NaN)."""
    import zarr

    rng = np.random.default_rng(2)
    group = zarr.open_group(str(tmp_path / "nan.zarr"), mode="w")
    data = {k: rng.normal(size=(32, 24)).astype(np.float32) for k in "abt"}
    data["a"][13, 9] = data["a"][20, 3] = data["t"][30, 22] = np.nan
    for name, value in data.items():
        array = group.create_array(
            name, shape=(32, 24), chunks=(16, 8), dtype=np.float32, dimension_names=("y", "x")
        )
        array[...] = value
    f = group.create_array(
        "f",
        shape=(32, 24),
        chunks=(16, 8),
        dtype=np.float32,
        fill_value=np.nan,
        dimension_names=("y", "x"),
    )
    f[:10] = 1.0
    return tmp_path / "nan.zarr", data


def test_a_window_holding_nan_is_refused_naming_the_variable_the_window_and_its_corner(tmp_path):
    path, _ = nan_field(tmp_path)
    grid = dict(patch={"y": 4, "x": 4}, shuffle=False)
    source = dfl.io.PatchSource(path, ["b", "a"], **grid)
    # windows in C order of 8 x 6 corners: (13, 9) is in the window at corner (12, 8)
    bad = source.corners.tolist().index([12, 8])
    with pytest.raises(
        dfl.DataError,
        match=rf"window {bad} \(corner \{{'y': 12, 'x': 8\}}\) of x\[1\] \('a'\) holds NaN; "
        r"pass nan='mask'",
    ):
        list(dfl.io.stream_batches(source, 8))
    # a target holding NaN is refused whatever nan= says
    target = dfl.io.PatchSource(path, "b", "t", nan="mask", **grid)
    with pytest.raises(dfl.DataError, match=r"corner \{'y': 28, 'x': 20\}\) of y \('t'\)"):
        target.read(np.arange(target.num_samples))
    # NaN as the store's fill value: a region never written
    unwritten = dfl.io.PatchSource(path, "f", patch={"y": 8, "x": 8}, windows=[[4, 0]])
    with pytest.raises(dfl.DataError, match=r"holds NaN; NaN is also 'f''s fill value"):
        unwritten.read(np.arange(1))
    with pytest.raises(dfl.ConfigError, match=r"nan='zero'.*'refuse'.*'mask'"):
        dfl.io.PatchSource(path, "a", nan="zero", **grid)


def test_nan_mask_reads_nan_as_zero_and_appends_a_channel_that_is_one_where_valid(tmp_path):
    path, data = nan_field(tmp_path)
    source = dfl.io.PatchSource(
        path, ["b", "a"], patch={"y": 4, "x": 4}, stride={"y": 3, "x": 5}, nan="mask"
    )
    assert source.sample_shape == (3, 4, 4)
    order = np.random.default_rng(0).permutation(source.num_samples)
    x = source.read(order).x.numpy()
    stacked = np.stack([data["b"], data["a"]])
    windows = np.stack([stacked[:, i : i + 4, j : j + 4] for i, j in source.corners[order]])
    valid = ~np.isnan(windows).any(axis=1)
    assert not valid.all()  # some window holds one of the NaN
    assert np.array_equal(x[:, :2], np.nan_to_num(windows, nan=0.0))
    assert np.array_equal(x[:, 2], valid.astype(np.float32))


# -- normalisation -------------------------------------------------------------------------


def test_normalization_stats_equal_numpy_over_the_whole_arrays_and_are_kept_beside_the_run(
    tmp_path,
):
    import zarr

    path, data = write_2d(tmp_path)
    group = zarr.open_group(str(path))
    rng = np.random.default_rng(7)
    skewed = (rng.gamma(2.0, 3.0, size=(64, 48)) + 1e4).astype(np.float32)
    skewed[5, 7] = np.nan  # left out, as nan="mask" reads it
    group.create_array(
        "s", shape=(64, 48), chunks=(16, 16), dtype=np.float32, dimension_names=("lat", "lon")
    )[...] = skewed
    source = dfl.io.PatchSource(path, ["a", "s"], patch={"lat": 8, "lon": 8}, nan="mask")
    run = tmp_path / "run"
    stats = dfl.io.normalization_stats(source, path=run)
    assert stats.variables == ("a", "s")
    for k, values in enumerate((data["a"], skewed)):
        values = values.astype(np.float64)
        assert stats.mean[k] == pytest.approx(np.nanmean(values), rel=1e-12, abs=1e-12)
        assert stats.std[k] == pytest.approx(np.nanstd(values), rel=1e-12)
    assert stats.count == (64 * 48, 64 * 48 - 1)
    # kept: the next call reads the file, not the store; another store is measured again
    kept = run / "normalization.json"
    assert dfl.io.NormalizationStats.from_json(kept) == stats
    # the file wins while the store's arrays look the same: their shapes, chunks, dtypes
    # and the values of their first, middle and last chunks (a chunk between changed)
    group["a"][20, 20] = 1e6
    assert dfl.io.normalization_stats(source, path=run) == stats
    remeasured = dfl.io.normalization_stats(source, path=run, refresh=True)
    assert remeasured.mean[0] != stats.mean[0] and remeasured.fingerprint == stats.fingerprint
    group["a"][20, 20] = data["a"][20, 20]
    group["a"][0, 0] = 1e6  # the store written again: its first chunk differs
    changed = dfl.io.normalization_stats(source, path=run)
    assert changed.mean[0] > stats.mean[0] and changed.fingerprint != stats.fingerprint
    group["a"][0, 0] = data["a"][0, 0]
    assert dfl.io.normalization_stats(source, path=run) == stats  # (measured again: the same)
    other = dfl.io.normalization_stats(path, ["a", "b"], path=run)
    assert other.variables == ("a", "b") and other.fingerprint != stats.fingerprint
    assert dfl.io.NormalizationStats.from_json(kept) == other
    # applied on the device per channel: the mask channel of nan="mask" left as it is
    standardize = dfl.ops.Standardize.from_stats(stats, source)
    assert standardize.mean == (stats.mean[0], stats.mean[1], 0.0)
    assert standardize.std == (stats.std[0], stats.std[1], 1.0)
    x = source.read(np.arange(4)).x
    out = standardize(x)
    expected = (x[:, 1].double() - stats.mean[1]) / stats.std[1]
    assert torch.allclose(out[:, 1].double(), expected, rtol=1e-5, atol=1e-3)  # float32 out
    assert torch.equal(out[:, 2], x[:, 2])
    with pytest.raises(dfl.ConfigError, match=r"statistics are of \['a', 'b'\]"):
        dfl.ops.Standardize.from_stats(other, source)
    with pytest.raises(dfl.ConfigError, match=r"holds several arrays; name the variables"):
        dfl.io.normalization_stats(path)
    group.create_array("n", shape=(4, 4), chunks=(2, 2), dtype=np.float32)[...] = np.nan
    with pytest.raises(dfl.DataError, match=r"variables\[0\] \('n'\) of .* holds no value"):
        dfl.io.normalization_stats(path, "n")


def test_x_and_y_cut_from_one_array_decode_each_stored_object_once_per_unit(tmp_path):
    """Tiles x time forecasting: y is x's array shifted in time, so a unit's objects
    are fetched once for both (one box holding x's and y's windows), not twice."""
    field = np.arange(16 * 16 * 16, dtype=np.float32).reshape(16, 16, 16)
    root = zarr.open_group(tmp_path / "f.zarr", mode="w")
    root.create_array(
        "t",
        shape=field.shape,
        chunks=(4, 8, 8),
        dtype=np.float32,
        dimension_names=("time", "lat", "lon"),
    )[...] = field

    class CountingStore(zarr.storage.LocalStore):
        gets: ClassVar[list[str]] = []

        def get_sync(self, key, *args, **kwargs):
            CountingStore.gets.append(key)
            return super().get_sync(key, *args, **kwargs)

    group = zarr.open_group(CountingStore(tmp_path / "f.zarr"), mode="r")
    source = dfl.io.PatchSource(
        group,
        "t",
        "t",
        patch={"time": 2, "lat": 8, "lon": 8},
        stride={"time": 1},
        y_shift={"time": 2},
        y_patch={"time": 1},
        channels=("time",),
        shuffle=False,
    )
    CountingStore.gets.clear()
    batches = source.read_chunks(range(len(source.chunk_members)))
    keys = [k for k in CountingStore.gets if "zarr.json" not in k]
    assert len(keys) == len(set(keys))  # every object read once: x and y from one box
    for unit, members in enumerate(source.chunk_members):
        for row, k in enumerate(members.tolist()):
            t, i, j = source.corner(k)
            assert np.array_equal(batches[unit].x[row], field[t : t + 2, i : i + 8, j : j + 8])
            assert np.array_equal(batches[unit].y[row], field[t + 2 : t + 3, i : i + 8, j : j + 8])


class _CountingStore(zarr.storage.LocalStore):
    """A local store that records the objects read (to count decodes)."""

    gets: ClassVar[list[str]] = []

    def get_sync(self, key, *args, **kwargs):
        _CountingStore.gets.append(key)
        return super().get_sync(key, *args, **kwargs)


def _random_crops(tmp_path, **kwargs):
    volume = np.arange(32**3, dtype=np.float32).reshape(32, 32, 32)
    root = zarr.open_group(tmp_path / "v.zarr", mode="w")
    root.create_array("v", shape=volume.shape, chunks=(8, 8, 8), dtype=np.float32)[...] = volume
    corners = np.random.default_rng(0).integers(0, 32 - 6, size=(300, 3))
    corners = np.unique(corners, axis=0)
    group = zarr.open_group(_CountingStore(tmp_path / "v.zarr"), mode="r")
    source = dfl.io.PatchSource(group, "v", patch={0: 6, 1: 6, 2: 6}, windows=corners, **kwargs)
    return volume, source


def test_a_shuffled_epoch_keeps_neighbouring_blocks_together_and_decodes_shared_chunks_once(
    tmp_path,
):
    volume, source = _random_crops(tmp_path, block=1)
    groups = source.chunk_groups
    members = source.chunk_members
    assert len(groups) == len(members) and len(set(groups)) > 1
    sizes = [len(m) for m in members]
    for epoch in (0, 1):
        [stream] = shard_epoch(
            sizes, [source.num_samples], seed=7, epoch=epoch, members=members, groups=groups
        )
        assert sorted(stream.tolist()) == list(range(source.num_samples))  # each once

        # the units' order (one sample per unit: no mixing within buffer groups)
        def unit_order(epoch=epoch):
            return shard_epoch(
                [1] * len(members), [len(members)], seed=7, epoch=epoch, buffer_chunks=1,
                groups=groups,
            )[0].tolist()  # fmt: skip

        units = unit_order()
        assert sorted(units) == list(range(len(members)))
        seen = [g for g, _ in itertools.groupby(groups[u] for u in units)]
        assert len(seen) == len(set(seen))  # a group's units follow each other
        assert unit_order() == units  # a pure function of (seed, epoch)
    # read in that order, each stored object is decoded once (the cache holds them all)
    _CountingStore.gets.clear()
    batches = source.read_chunks(units)
    keys = [k for k in _CountingStore.gets if "zarr.json" not in k]
    assert len(keys) == len(set(keys))
    for unit in units:
        for row, k in enumerate(source.chunk_members[unit].tolist()):
            a, b, c = source.corner(k)
            assert np.array_equal(batches[unit].x[row, 0], volume[a : a + 6, b : b + 6, c : c + 6])
    # without the cache, the objects windows reach into are decoded again by the next units
    _, uncached = _random_crops(tmp_path / "off", block=1, chunk_cache_mb=0)
    _CountingStore.gets.clear()
    uncached.read_chunks(units)
    keys = [k for k in _CountingStore.gets if "zarr.json" not in k]
    assert len(keys) > len(set(keys))


def test_chunk_cache_mb_must_be_a_number_of_mb(tmp_path):
    path, _ = write_2d(tmp_path)
    for bad in (-1, "256", True):
        with pytest.raises(dfl.errors.ConfigError, match=r"chunk_cache_mb=.*number >= 0"):
            dfl.io.PatchSource(path, "a", patch={"lat": 8, "lon": 8}, chunk_cache_mb=bad)


def test_an_array_in_memory_cut_along_its_last_axes_is_shuffled_as_one_block():
    """No storage chunks: the block is the whole array (it used to index the patch
    extents by the array's axes, an IndexError for patch dims after the first)."""
    field = np.arange(3 * 16 * 12, dtype=np.float32).reshape(3, 16, 12)
    source = dfl.io.PatchSource(field, patch={1: 8, 2: 6})
    assert source.num_samples == 4
    got = source.read(np.arange(4)).x.numpy()[:, 0]
    corners = source.corners.tolist()
    expected = [field[:, a : a + 8, b : b + 6] for a, b in corners]
    np.testing.assert_array_equal(got, np.stack(expected))
