"""PatchSource regions (spatial layouts): a spatial rank reads only its part of each
window, and that part equals the same slice of the whole window."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_patch_source import write_2d, write_3d

import dataflow as dfl


def whole_and_region(source, bounds, indices):
    """The windows at ``indices`` read whole and through ``source.region(bounds)``."""
    view = source.region(bounds)
    whole, part = source.read(indices), view.read(indices)
    cut = tuple(slice(lo, hi) for lo, hi in view.region_bounds)
    return whole, part, cut, view


@pytest.mark.parametrize(
    "bounds", [{1: (0, 5)}, {2: (3, 9), 3: (4, 8)}, {1: (5, 10), 2: (0, 12), 3: (6, 12)}]
)
def test_a_region_of_3d_crops_is_the_slice_of_the_whole_crop(tmp_path, bounds):
    path, _vol = write_3d(tmp_path)
    source = dfl.io.PatchSource(path, patch={0: 10, 1: 12, 2: 12}, stride={0: 5, 1: 7, 2: 5})
    indices = np.random.default_rng(0).permutation(source.num_samples)[:9]
    whole, part, cut, view = whole_and_region(source, bounds, indices)
    assert tuple(part.x.shape[1:]) == view.region_shape
    assert view.region_shape != source.sample_shape
    assert np.array_equal(part.x.numpy(), whole.x.numpy()[(slice(None), *cut)])


def test_a_region_cuts_whole_dims_folded_channels_and_leaves_y_whole(tmp_path):
    """x = the level dim folded into channels with two variables; the region narrows
    the channels after assembling them, a whole (unpatched) dim, and a patch dim."""
    path, _data = write_2d(tmp_path)
    source = dfl.io.PatchSource(
        path, ["ab", "ab"], "lab", patch={"lat": 16}, stride={"lat": 8}, channels=("level",)
    )
    assert source.sample_shape == (4, 16, 48)
    indices = np.arange(source.num_samples)[::-1]
    whole, part, cut, _ = whole_and_region(source, {0: (1, 3), 1: (4, 12), 2: (10, 40)}, indices)
    assert np.array_equal(part.x.numpy(), whole.x.numpy()[(slice(None), *cut)])
    assert np.array_equal(part.y.numpy(), whole.y.numpy())  # targets are read whole


def test_a_region_of_a_forecast_window_with_nan_mask(tmp_path):
    path, data = write_2d(tmp_path)
    import zarr

    group = zarr.open_group(str(path), mode="a")
    holes = data["a"].copy()
    holes[3:9, 20:30] = np.nan
    group["a"][...] = holes
    source = dfl.io.PatchSource(
        path, "a", "b", patch={"lat": 8, "lon": 16}, y_shift={"lat": 8}, nan="mask"
    )
    indices = np.arange(source.num_samples)
    whole, part, cut, view = whole_and_region(source, {2: (2, 10), 1: (0, 4)}, indices)
    assert view.region_shape == (2, 4, 8)  # the mask channel is a channel like the others
    assert np.array_equal(part.x.numpy(), whole.x.numpy()[(slice(None), *cut)])
    assert np.array_equal(part.y.numpy(), whole.y.numpy())


def test_a_region_reads_and_checks_only_the_chunks_it_touches(tmp_path):
    """A chunk outside rank 0's half (16-row chunks, the window's upper half) may be
    missing: the region's epoch trains; the whole source names the chunk."""
    path, vol = write_3d(tmp_path)
    source = dfl.io.PatchSource(path, patch={0: 32}, shuffle=False)  # windows: lo 0, one
    (path / "c" / "1" / "0" / "0").unlink()  # z rows 16..31: the upper half only
    lower = source.region({1: (0, 16)})
    [batch] = dfl.io.stream_batches(lower, 1)
    assert np.array_equal(batch.x.numpy()[0, 0], vol[:16])
    with pytest.raises(dfl.ChunkMissingError, match=r"c/1/0/0"):
        list(dfl.io.stream_batches(source, 1))
    with pytest.raises(dfl.ChunkMissingError, match=r"c/1/0/0"):
        list(dfl.io.stream_batches(source.region({1: (8, 24)}), 1))


def test_a_region_view_pickles_composes_and_refuses_a_region_outside_it(tmp_path):
    path, _vol = write_3d(tmp_path)
    source = dfl.io.PatchSource(path, patch={0: 8, 1: 8, 2: 8})
    view = pickle.loads(pickle.dumps(source.region({1: (2, 8)})))
    assert "region=" in repr(view)
    narrower = view.region({1: (4, 6), 3: (0, 4)})
    indices = np.arange(0, source.num_samples, 5)
    whole = source.read(indices).x.numpy()
    assert np.array_equal(narrower.read(indices).x.numpy(), whole[:, :, 4:6, :, 0:4])
    with pytest.raises(dfl.errors.ConfigError, match=r"already a region"):
        view.region({1: (0, 4)})
    with pytest.raises(dfl.errors.ConfigError, match=r"axis 4 is not an axis"):
        source.region({4: (0, 1)})
