"""PatchSource's direct cut: a zarr array decoded here has each window copied once,
straight from the decoded storage chunks it overlaps, never through the unit's bounding
box; it must equal the box path (numpy, dask, sharded stores) window for window."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from test_patch_source import precut, write_2d, write_3d

import dataflow as dfl


def box_path(source):
    """``source`` read the way arrays without the chunk decoder are: each stored array's
    bounding box read through zarr itself, the windows cut from it."""
    for array in source._open():
        array.reader.decoder = None
        assert not array.cuts_direct
    return source


def straddling(rng, shape, patch, chunks, n):
    """``n`` distinct random corners, most of whose windows cross a chunk edge."""
    high = np.asarray(shape) - np.asarray(patch)
    corners = np.unique(rng.integers(0, high + 1, size=(4 * n, len(shape))), axis=0)
    corners = corners[rng.permutation(len(corners))[:n]]
    crosses = ((corners % chunks) + patch > chunks).any(axis=1)
    assert crosses.mean() > 0.3  # the case the direct cut has to get right
    return corners


@pytest.mark.parametrize("region", [None, {1: (2, 9), 2: (0, 7), 3: (3, 9)}])
def test_the_direct_cut_of_3d_crops_straddling_chunk_edges_equals_the_box_cut(tmp_path, region):
    path, vol = write_3d(tmp_path)
    patch = (10, 12, 9)
    corners = straddling(np.random.default_rng(3), vol.shape, patch, 16, 40)
    options = dict(patch={0: 10, 1: 12, 2: 9}, windows=corners, block=1)
    direct = dfl.io.PatchSource(path, **options)
    boxed = box_path(dfl.io.PatchSource(path, **options))
    in_numpy = dfl.io.PatchSource(vol, **options)
    assert direct._open()[0].cuts_direct and len(direct.chunk_members) > 1
    if region is not None:
        direct, boxed, in_numpy = (s.region(region) for s in (direct, boxed, in_numpy))
    indices = np.random.default_rng(4).permutation(direct.num_samples)
    got = direct.read(indices).x.numpy()
    want = precut(vol, direct.corners[indices], patch, (0, 1, 2))[:, None]
    if region is not None:
        want = want[(slice(None), *(slice(lo, hi) for lo, hi in direct.region_bounds))]
    assert got.shape == (len(indices), *direct.region_shape)
    assert np.array_equal(got, want)
    assert np.array_equal(got, boxed.read(indices).x.numpy())
    assert np.array_equal(got, in_numpy.read(indices).x.numpy())


def cut_directly(source) -> int:
    """How many units of ``source`` have their x cut straight from the chunks."""
    arrays = source._open()
    shared = [k for k, a in enumerate(arrays) if a.name == arrays[0].name]  # x and y of one
    return sum(
        arrays[0].cuts_from_chunks([source._windows(m)[k] for k in shared])
        for m in source.chunk_members
    )


@pytest.mark.parametrize("region", [None, {0: (1, 2), 1: (1, 5), 2: (2, 7)}])
def test_the_direct_cut_of_2d_windows_with_y_and_several_x_equals_the_box_cut(tmp_path, region):
    """Two x arrays, y a third (segmentation); y cut from x's own array (forecast: its
    chunks shared with x's windows); and overlapping windows (stride 1), which are cut
    from their box; at random corners across chunk edges."""
    path, data = write_2d(tmp_path)
    corners = straddling(np.random.default_rng(5), (64, 48), (6, 9), 16, 30)
    grid = dict(patch={"lat": 6, "lon": 9}, windows=corners, block=1)
    forecast = {"y_shift": {"lat": 12, "lon": -1}, "y_patch": {"lat": 4}}
    below = corners[(corners[:, 0] <= 48) & (corners[:, 1] >= 1)]  # y inside the array
    for x, y, extra, directly in (
        (["a", "b"], "lab", grid, True),
        ("a", "a", {**grid, **forecast, "windows": below}, True),
        ("a", "a", {**forecast, "patch": {"lat": 6, "lon": 9}, "stride": {"lat": 1}}, False),
    ):
        direct = dfl.io.PatchSource(path, x, y, **extra)
        boxed = box_path(dfl.io.PatchSource(path, x, y, **extra))
        assert len(direct.chunk_members) > 1
        if directly:
            assert cut_directly(direct) > 0
        else:  # overlapping windows: most units through the box (with the decoder)
            assert cut_directly(direct) < len(direct.chunk_members) / 2
        if region is not None and "y_shift" not in extra:
            direct, boxed = direct.region(region), boxed.region(region)
        indices = np.random.default_rng(6).permutation(direct.num_samples)
        got, want = direct.read(indices), boxed.read(indices)
        assert np.array_equal(got.x.numpy(), want.x.numpy())
        assert np.array_equal(got.y.numpy(), want.y.numpy())
        if "y_shift" not in extra:  # and both equal the windows cut by hand
            at = direct.corners[indices]
            hand = np.stack([precut(data[n], at, (6, 9), (0, 1)) for n in x], axis=1)
            if region is not None:
                hand = hand[(slice(None), *(slice(lo, hi) for lo, hi in direct.region_bounds))]
            assert np.array_equal(got.x.numpy(), hand)
        else:
            at = direct.corners[indices] + [12, -1]
            assert np.array_equal(got.y.numpy(), precut(data["a"], at, (4, 9), (0, 1)))


def test_a_unit_is_cut_from_the_chunks_its_windows_touch_not_its_bounding_box(tmp_path):
    """Two windows at opposite corners of a 96^3 volume make one unit (unshuffled): the
    read decodes the two chunks they lie in and allocates about their bytes, not the
    3.4 MiB box between them (which the box path decodes and fills whole)."""
    import zarr

    vol = np.random.default_rng(0).normal(size=(96, 96, 96)).astype(np.float32)
    array = zarr.open_array(
        str(tmp_path / "v.zarr"), mode="w", shape=vol.shape, chunks=(16,) * 3, dtype="f4"
    )
    array[...] = vol
    corners = np.array([[0, 0, 0], [88, 88, 88]])
    source = dfl.io.PatchSource(
        tmp_path / "v.zarr",
        patch={0: 8, 1: 8, 2: 8},
        windows=corners,
        shuffle=False,
        chunk_cache_mb=0,
    )
    assert [len(m) for m in source.chunk_members] == [2]  # one unit: its box is the volume
    decoder = source._open()[0].reader.decoder
    # tracemalloc counts every thread's allocations, and a long suite leaves threads of
    # its own behind (a client's IO loop, a store server's): the least of three reads'
    # peaks is this read's (the box path allocates its 3.4 MiB on every read)
    peaks = []
    for attempt in range(3):
        tracemalloc.start()
        try:
            batch = source.read_chunks([0])[0]
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        if attempt == 0:  # the two chunks the windows lie in, not the box's 216
            assert len(decoder.decoded) == 2
    assert np.array_equal(batch.x.numpy()[:, 0], precut(vol, corners, (8, 8, 8), (0, 1, 2)))
    assert min(peaks) < vol.nbytes // 16  # a chunk or two in flight (16 KiB each), not the box
