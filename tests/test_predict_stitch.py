"""``Pipeline.predict(source, model, out, stitch=True)``: a PatchSource's window outputs
put back into the field, each cell the mean over the windows covering it.

The exact check: a per-cell model (1x1 convolution) gives every window the field's own
values, so the stitched field must equal the model applied to the whole field, cell for
cell, and be NaN exactly where no window reaches. The pure parts (which windows touch
which rows, where an output lands, the averages) are checked against brute force."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import zarr
from test_patch_source import SegNet, seg_pipeline, tiles, write_2d, write_3d

import dataflow as dfl
from dataflow.core.errors import ConfigError
from dataflow.stitching import (
    GAUSSIAN_FLOOR,
    FieldLayout,
    add_window,
    averaged,
    gaussian_weights,
    share_axis,
)


def _covered(shape, corners, patch) -> np.ndarray:
    """Cells any window covers, by hand."""
    mask = np.zeros(shape, dtype=bool)
    for corner in corners:
        mask[tuple(slice(c, c + p) for c, p in zip(corner, patch, strict=True))] = True
    return mask


@pytest.mark.parametrize("seed", range(20))
def test_the_windows_touching_a_row_range_are_those_brute_force_finds(seed):
    rng = np.random.default_rng(seed)
    rows, patch = int(rng.integers(5, 40)), int(rng.integers(1, 8))
    starts = np.sort(rng.choice(max(1, rows - patch + 1), size=int(rng.integers(1, 10))))
    layout = FieldLayout((rows,), (0,), (patch,), starts[:, None].astype(np.int64))
    lo = int(rng.integers(0, rows))
    hi = int(rng.integers(lo + 1, rows + 1))
    touching = [i for i, c in enumerate(starts) if c < hi and c + patch > lo]
    assert layout.windows_touching(lo, hi).tolist() == touching


@pytest.mark.parametrize("seed", range(10))
def test_the_windows_touching_rows_of_a_later_patch_axis_are_those_brute_force_finds(seed):
    """Shares cut along the second patch axis: the windows meeting a range of its rows
    are not one run of indices (the corners are in C order), and each lands clipped to
    the range along that axis only."""
    rng = np.random.default_rng(seed)
    field, patch = (
        (int(rng.integers(4, 12)), int(rng.integers(10, 40))),
        (3, int(rng.integers(1, 8))),
    )
    grid = [np.arange(0, field[d] - patch[d] + 1, int(rng.integers(1, 4))) for d in range(2)]
    corners = np.stack(np.meshgrid(*grid, indexing="ij"), -1).reshape(-1, 2).astype(np.int64)
    layout = FieldLayout(field, (0, 1), patch, corners, window=patch, share=1)
    assert layout.rows_dim == 1 and layout.rows == field[1]
    lo = int(rng.integers(0, field[1]))
    hi = int(rng.integers(lo + 1, field[1] + 1))
    touching = [i for i, c in enumerate(corners) if c[1] < hi and c[1] + patch[1] > lo]
    assert layout.windows_touching(lo, hi).tolist() == touching
    for index in touching:
        field_at, out_at = layout.place(corners[index], lo, hi)
        rows = range(*field_at[1].indices(hi - lo))
        assert rows.start + lo >= max(lo, corners[index][1]) and len(rows) >= 1
        assert field_at[0] == slice(int(corners[index][0]), int(corners[index][0]) + 3)
        assert out_at[1].stop - out_at[1].start == len(rows)


def test_the_shares_are_cut_along_the_axis_with_the_most_window_positions():
    """A volume one window spans in depth (one start along axis 0) is cut across its
    rows, not into depth slabs that every window touches; ties keep the first axis."""
    depth = np.stack(np.meshgrid([0], [0, 8, 16], [0, 8], indexing="ij"), -1).reshape(-1, 3)
    assert share_axis(depth) == 1
    square = np.stack(np.meshgrid([0, 4], [0, 4], indexing="ij"), -1).reshape(-1, 2)
    assert share_axis(square) == 0


def test_overlapping_windows_average_and_parts_of_rows_join_to_the_whole():
    """Windows of 4 cells at 0, 3 and 6 over 11 cells, each output its own constant:
    overlaps hold the mean, cell 10 none (NaN); summed in two parts of rows or at once."""
    layout = FieldLayout((11,), (0,), (4,), np.array([[0], [3], [6]]))
    outputs = [np.full((1, 4), k + 1.0) for k in range(3)]

    def part(lo, hi):
        sums, counts = np.zeros((1, hi - lo)), np.zeros(hi - lo, dtype=np.int32)
        for index in layout.windows_touching(lo, hi):
            add_window(sums, counts, layout, layout.corners[index], outputs[index], lo, hi)
        return averaged(sums, counts)

    whole, uncovered = part(0, 11)
    want = [1, 1, 1, 1.5, 2, 2, 2.5, 3, 3, 3, np.nan]
    np.testing.assert_array_equal(whole[0], np.array(want, dtype=np.float32))
    assert uncovered == 1
    (left, _), (right, _) = part(0, 5), part(5, 11)
    np.testing.assert_array_equal(np.concatenate([left, right], axis=1), whole)


def test_gaussian_weights_favour_each_windows_centre():
    """Two windows of 8 cells at 0 and 4, outputs 1 and 3: with ``blend="gaussian"`` a
    shared cell leans to the window whose centre is nearer, symmetrically; "mean" gives
    2 everywhere they overlap."""
    weights = gaussian_weights((8, 5), (0,))
    assert weights.shape == (8, 5) and (weights[:, 0] == weights[:, 4]).all()
    assert weights[3, 0] == weights[4, 0] == 1.0 and weights.min() >= GAUSSIAN_FLOOR
    np.testing.assert_allclose(weights[:, 0], weights[::-1, 0])
    corners = np.array([[0], [4]])
    stitched = {}
    for blend in ("mean", "gaussian"):
        w = gaussian_weights((8,), (0,)) if blend == "gaussian" else None
        layout = FieldLayout((12,), (0,), (8,), corners, weights=w)
        sums, counts = np.zeros((1, 12)), np.zeros(12)
        for k, corner in enumerate(corners):
            add_window(sums, counts, layout, corner, np.full((1, 8), 1.0 + 2 * k), 0, 12)
        stitched[blend] = averaged(sums, counts)[0][0]
    np.testing.assert_array_equal(stitched["mean"][4:8], 2.0)
    shared = stitched["gaussian"][4:8]
    assert shared[0] < 2.0 < shared[3] and shared[1] < 2.0 < shared[2]
    np.testing.assert_allclose(shared + shared[::-1], 4.0, rtol=1e-6)
    assert (stitched["gaussian"][:4] == 1.0).all() and (stitched["gaussian"][8:] == 3.0).all()


def _pointwise(c_in: int, c_out: int, dims: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return (torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d)(c_in, c_out, 1)


def _stitched(source, model, out, *, uncovered: bool = True, **options):
    """The stitched array; a RuntimeWarning names the uncovered cells, if there are any."""
    pipe = seg_pipeline(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.predict(source, model, out, stitch=True, batch_size=7, **options)
    named = [w for w in caught if "covered by no window" in str(w.message)]
    assert len(named) == (1 if uncovered else 0), [str(w.message) for w in caught]
    return zarr.open_group(str(out))["prediction"]


@pytest.mark.parametrize("blend", ["mean", "gaussian"])
def test_a_per_cell_model_stitched_over_overlapping_tiles_is_the_model_on_the_field(
    tmp_path, blend
):
    """8 x 8 tiles every 5 x 6 cells of a 64 x 48 field (row 63 and columns 44-47 in no
    tile); sums held 3 rows at a time (memory_mb), so each part takes its windows again.
    Every window gives a cell the same value, so any weighting averages to it."""
    path, data = write_2d(tmp_path)
    source = tiles(path, shuffle=True)
    model = _pointwise(2, 3, 2)
    rows = dict(chunk_mb=3 * 48 * 3 * 4 / 1e6, memory_mb=3 * 48 * 4 * 8 / 1e6)  # 3 rows
    array = _stitched(source, model, tmp_path / "out.zarr", blend=blend, **rows)
    assert array.shape == (3, 64, 48) and array.chunks == (3, 3, 48)
    assert tuple(array.metadata.dimension_names) == ("channel", "lat", "lon")
    with torch.no_grad():
        want = model(torch.from_numpy(np.stack([data["a"], data["b"]]))[None])[0].numpy()
    got = array[...]
    covered = _covered((64, 48), source.corners, (8, 8))
    assert not covered[63].any() and not covered[:, 44:].any() and covered[:63, :44].all()
    np.testing.assert_allclose(got[:, covered], want[:, covered], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[:, ~covered]).all()


def test_a_volume_with_a_folded_level_axis_and_3d_windows(tmp_path):
    """Channels folded from x's own axis (``channels=['level']``) stay out of the field;
    a 3-D volume's windows go back along three axes."""
    path, data = write_2d(tmp_path)
    folded = dfl.io.PatchSource(
        path, "ab", patch={"lat": 16, "lon": 16}, stride={"lat": 12, "lon": 16}, channels=["level"]
    )
    model = _pointwise(2, 1, 2)
    got = _stitched(folded, model, tmp_path / "folded.zarr", uncovered=False)[...]
    with torch.no_grad():
        want = model(torch.from_numpy(data["ab"])[None])[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # (every cell covered)

    vol_path, vol = write_3d(tmp_path)
    volume = dfl.io.PatchSource(vol_path, patch={0: 16, 1: 16, 2: 16}, stride={0: 12, 1: 10, 2: 16})
    model = _pointwise(1, 2, 3)
    got = _stitched(volume, model, tmp_path / "vol_out.zarr")[...]
    with torch.no_grad():
        want = model(torch.from_numpy(vol)[None, None])[0].numpy()
    covered = _covered(vol.shape, volume.corners, (16, 16, 16))
    assert got.shape == (2, 40, 36, 28) and (~covered).any()
    np.testing.assert_allclose(got[:, covered], want[:, covered], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[:, ~covered]).all()


def write_slab(tmp_path):
    """A volume thin in depth: 8 x 40 x 24, chunked (8, 16, 8)."""
    rng = np.random.default_rng(2)
    vol = rng.normal(size=(8, 40, 24)).astype(np.float32)
    array = zarr.open_array(
        str(tmp_path / "slab.zarr"), mode="w", shape=vol.shape, chunks=(8, 16, 8), dtype=np.float32
    )
    array[...] = vol
    return tmp_path / "slab.zarr", vol


def slab_windows(path):
    """Windows as deep as the slab, every 6 x 4 cells across it."""
    return dfl.io.PatchSource(path, patch={0: 8, 1: 8, 2: 8}, stride={0: 8, 1: 6, 2: 4})


def test_a_slab_one_window_deep_is_written_in_parts_across_its_rows(tmp_path):
    """One window spans the slab's depth, so its field is cut along its second axis (the
    most window positions): written 5 rows a chunk, summed 5 rows a part, each part with
    the windows touching it (not one run of indices), and equal to the model on the
    whole slab wherever a window covers it."""
    path, vol = write_slab(tmp_path)
    source = slab_windows(path)
    model = _pointwise(1, 2, 3)
    row = 2 * 8 * 24  # channels x depth x width cells
    parts = dict(chunk_mb=5 * row * 4 / 1e6, memory_mb=5 * (row // 2) * 3 * 8 / 1e6)
    array = _stitched(source, model, tmp_path / "slab_out.zarr", **parts)
    assert array.shape == (2, 8, 40, 24) and array.chunks == (2, 8, 5, 24)
    with torch.no_grad():
        want = model(torch.from_numpy(vol)[None, None])[0].numpy()
    got = array[...]
    covered = _covered(vol.shape, source.corners, (8, 8, 8))
    assert (~covered).any() and covered[:, :38, :].all()
    np.testing.assert_allclose(got[:, covered], want[:, covered], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[:, ~covered]).all()


def test_what_cannot_be_stitched_is_named(tmp_path):
    path, _ = write_2d(tmp_path)
    source = tiles(path)
    pipe = seg_pipeline(source)
    with pytest.raises(ConfigError, match=r"'mean' .* or 'gaussian'"):
        pipe.predict(source, SegNet(), tmp_path / "c.zarr", stitch=True, blend="cosine")
    with pytest.raises(ConfigError, match="pass stitch=True too"):
        pipe.predict(source, SegNet(), tmp_path / "d.zarr", blend="gaussian")
    classifier = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(128, 3))
    with pytest.raises(ConfigError, match=r"output per window is \(3,\).*one value per cell"):
        pipe.predict(source, classifier, tmp_path / "a.zarr", stitch=True)
    rows = dfl.io.ArraySource(np.zeros((4, 2, 8, 8), np.float32))
    with pytest.raises(ConfigError, match=r"needs a dataflow\.io\.PatchSource"):
        pipe.predict(rows, SegNet(), tmp_path / "b.zarr", stitch=True)
    flat = torch.nn.Flatten(2, 3)  # (2, 8, 8) -> (2, 64): per cell, but not window-shaped
    with pytest.raises(ConfigError, match=r"is \(2, 64\), but stitching needs \(channels"):
        pipe.predict(source, flat, tmp_path / "e.zarr", stitch=True)


def write_weather(tmp_path, steps: int = 10):
    """Two variables on a (time, lat, lon) grid of 10 x 16 x 12, chunked (2, 8, 8)."""
    rng = np.random.default_rng(1)
    group = zarr.open_group(str(tmp_path / "weather.zarr"), mode="w")
    data = {}
    for name in ("t2m", "u10"):
        data[name] = rng.normal(size=(steps, 16, 12)).astype(np.float32)
        array = group.create_array(
            name,
            shape=data[name].shape,
            chunks=(2, 8, 8),
            dtype=np.float32,
            dimension_names=("time", "lat", "lon"),
        )
        array[...] = data[name]
    return str(tmp_path / "weather.zarr"), data


@pytest.mark.parametrize("blend", ["mean", "gaussian"])
def test_a_forecast_is_stitched_where_its_y_windows_lie(tmp_path, blend):
    """x: both variables at t and t+1 (time folded into 4 channels), y: t2m at t+2, on
    8 x 8 tiles every 4 x 4 cells. A per-cell model's stitched forecast, a field of y's
    shape, is the model on the whole map at every t + 2 a window predicts (times 0 and
    1, which none does, NaN), with outputs of y's own window shape (1, 8, 8)."""
    path, data = write_weather(tmp_path)
    window = dict(patch={"time": 2, "lat": 8, "lon": 8}, stride={"time": 1, "lat": 4, "lon": 4})
    source = dfl.io.PatchSource(
        path,
        ["t2m", "u10"],
        "t2m",
        y_shift={"time": 2},
        y_patch={"time": 1},
        channels=("time",),
        **window,
    )
    assert source.sample_shape == (4, 8, 8)
    model = _pointwise(4, 1, 2)  # (4, 8, 8) -> (1, 8, 8): y's window, time first
    rows = dict(chunk_mb=3 * 16 * 12 * 4 / 1e6, memory_mb=3 * 16 * 12 * 2 * 8 / 1e6)
    array = _stitched(source, model, tmp_path / "forecast.zarr", blend=blend, **rows)
    assert array.shape == (1, 10, 16, 12) and array.chunks == (1, 3, 16, 12)
    assert tuple(array.metadata.dimension_names) == ("channel", "time", "lat", "lon")
    got = array[...]
    assert np.isnan(got[:, :2]).all()  # no window predicts times 0 and 1
    for t in range(8):
        inputs = np.stack([data["t2m"][t], data["t2m"][t + 1], data["u10"][t], data["u10"][t + 1]])
        with torch.no_grad():
            want = model(torch.from_numpy(inputs)[None])[0].numpy()
        np.testing.assert_allclose(got[:, t + 2], want, rtol=1e-5, atol=1e-6)


def _here_and_there(source, model, client, tmp_path, chunk_mb: float):
    """The field stitched in this process and on ``client``'s workers (each warns of the
    cells no window covers)."""
    pipe = seg_pipeline(source)
    fields = []
    for name, where in (("here", None), ("there", client)):
        with pytest.warns(RuntimeWarning):
            pipe.predict(
                source,
                model,
                tmp_path / f"{name}.zarr",
                stitch=True,
                chunk_mb=chunk_mb,
                client=where,
            )
        fields.append(zarr.open_group(str(tmp_path / f"{name}.zarr"))["prediction"])
    return fields


@pytest.mark.slow  # real worker processes
def test_workers_stitch_their_own_rows_as_one_process_does(client, tmp_path):
    """On the cluster each worker takes whole row chunks and computes every window that
    touches them (windows over a share's edge twice): the field equals the one written
    in this process, for a model with padded 3x3 convolutions (a window's edge cells
    differ from its neighbour's, so the averages are real)."""
    path, _ = write_2d(tmp_path)
    source = tiles(path)
    torch.manual_seed(0)
    model = SegNet()
    chunk_mb = 16 * 48 * 3 * 4 / 1e6  # 16-row chunks: 4 of them
    here, there = _here_and_there(source, model, client, tmp_path, chunk_mb)
    assert there.chunks == (3, 16, 48)
    np.testing.assert_allclose(there[...], here[...], rtol=1e-6, atol=1e-6, equal_nan=True)
    assert np.isfinite(here[:, :63, :44]).all()


@pytest.mark.slow  # real worker processes
def test_workers_stitch_a_slab_across_its_rows_as_one_process_does(client, tmp_path):
    """A slab one window deep is shared across its second axis: two workers write the
    field this process writes (3x3x3 padded convolutions: real averages at the edges)."""
    path, _ = write_slab(tmp_path)
    source = slab_windows(path)
    torch.manual_seed(0)
    model = torch.nn.Conv3d(1, 2, 3, padding=1)
    chunk_mb = 10 * 2 * 8 * 24 * 4 / 1e6  # 10-row chunks
    here, there = _here_and_there(source, model, client, tmp_path, chunk_mb)
    assert there.chunks == (2, 8, 10, 24)
    np.testing.assert_allclose(there[...], here[...], rtol=1e-6, atol=1e-6, equal_nan=True)
    assert np.isfinite(here[:, :, :38]).all()
