"""PatchSource: samples that are windows of a large N-D array, and the engine's chunks as
sets of samples (``chunk_members``) that such windows need."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

import dataflow as dfl
from dataflow.core.batch import Batch
from dataflow.io.chunk_reader import EpochChunkReader, is_chunked
from dataflow.io.sharding import shard_epoch

# -- the engine: chunks as member lists ---------------------------------------------------


class MemberSource:
    """An in-memory chunked source whose chunks are strided sets of samples."""

    def __init__(self, n: int, chunks: int) -> None:
        self.x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
        self.chunk_members = [np.arange(c, n, chunks, dtype=np.int64) for c in range(chunks)]
        self.reads: list[int] = []

    @property
    def num_samples(self) -> int:
        return len(self.x)

    def check_chunks(self, chunks: Sequence[int]) -> None:
        pass

    def read_chunks(self, chunks: Sequence[int]) -> dict[int, Batch]:
        self.reads.extend(chunks)
        out = {}
        for c in chunks:
            rows = self.chunk_members[c]
            out[c] = Batch(x=torch.from_numpy(self.x[rows]), y=None, size=len(rows))
        return out

    def read(self, indices: np.ndarray) -> Batch:
        return Batch(x=torch.from_numpy(self.x[indices]), y=None, size=len(indices))


def test_shard_epoch_with_members_reads_each_chunks_members_and_every_sample_once():
    members = [np.array([0, 5, 9]), np.array([1, 2]), np.array([3, 4, 6, 7, 8])]
    sizes = [len(m) for m in members]
    for shuffle in (False, True):
        streams = shard_epoch(
            sizes, [4, 6], seed=3, epoch=1, shuffle=shuffle, buffer_chunks=1, members=members
        )
        assert sorted(np.concatenate(streams).tolist()) == list(range(10))
        # the same positions as the run layout, mapped through the members
        runs = shard_epoch(sizes, [4, 6], seed=3, epoch=1, shuffle=shuffle, buffer_chunks=1)
        flat = np.concatenate(members)
        for got, positions in zip(streams, runs, strict=True):
            assert got.tolist() == flat[positions].tolist()
    [unshuffled] = shard_epoch(sizes, [10], seed=0, epoch=0, shuffle=False, members=members)
    assert unshuffled.tolist() == [0, 5, 9, 1, 2, 3, 4, 6, 7, 8]
    with pytest.raises(dfl.errors.ConfigError, match="member lists do not match"):
        shard_epoch([3, 3], [4], seed=0, epoch=0, members=members)


def test_the_chunk_reader_decodes_each_member_chunk_once_and_places_every_sample():
    source = MemberSource(40, 4)
    assert is_chunked(source)
    [order] = shard_epoch(
        [10] * 4, [40], seed=1, epoch=0, buffer_chunks=2, members=source.chunk_members
    )
    batches = [order[i : i + 7] for i in range(0, 40, 7)]
    got = list(EpochChunkReader(source, batches, decode_threads=1))
    assert sorted(source.reads) == [0, 1, 2, 3]
    for batch, indices in zip(got, batches, strict=True):
        assert batch.x[:, 0].tolist() == indices.astype(np.float32).tolist()


# -- PatchSource: stores written here ------------------------------------------------------


def write_2d(tmp_path, *, levels: bool = False):
    """Two 64 x 48 fields (or one with a level dim) and labels, in 16 x 16 chunks."""
    import zarr

    rng = np.random.default_rng(0)
    group = zarr.open_group(str(tmp_path / "field.zarr"), mode="w")
    a = rng.normal(size=(64, 48)).astype(np.float32)
    b = rng.normal(size=(64, 48)).astype(np.float32)
    lab = ((a + b) > 0).astype(np.int64) + (a > 1).astype(np.int64)
    for name, data in (("a", a), ("b", b), ("lab", lab)):
        array = group.create_array(
            name,
            shape=data.shape,
            chunks=(16, 16),
            dtype=data.dtype,
            dimension_names=("lat", "lon"),
        )
        array[...] = data
    stacked = np.stack([a, b])
    array = group.create_array(
        "ab",
        shape=stacked.shape,
        chunks=(2, 16, 16),
        dtype=np.float32,
        dimension_names=("level", "lat", "lon"),
    )
    array[...] = stacked
    return tmp_path / "field.zarr", {"a": a, "b": b, "lab": lab, "ab": stacked}


def write_3d(tmp_path):
    import zarr

    rng = np.random.default_rng(1)
    vol = rng.normal(size=(40, 36, 28)).astype(np.float32)
    array = zarr.open_array(
        str(tmp_path / "vol.zarr"),
        mode="w",
        shape=vol.shape,
        chunks=(16, 16, 16),
        dtype=np.float32,
    )
    array[...] = vol
    return tmp_path / "vol.zarr", vol


def precut(array: np.ndarray, corners: np.ndarray, patch, axes) -> np.ndarray:
    """The windows at ``corners`` cut by hand (``axes``: the patch axes of ``array``)."""
    out = []
    for corner in corners:
        index = [slice(None)] * array.ndim
        for c, p, axis in zip(corner, patch, axes, strict=True):
            index[axis] = slice(c, c + p)
        out.append(array[tuple(index)])
    return np.stack(out)


def streamed(source, batch: int = 7, **options):
    batches = list(dfl.io.stream_batches(source, batch, **options))
    x = np.concatenate([b.x.numpy() for b in batches])
    y = None if batches[0].y is None else np.concatenate([b.y.numpy() for b in batches])
    return np.concatenate([b.indices for b in batches]), x, y, batches


def test_unshuffled_windows_of_a_2d_field_stream_in_c_order_as_cut_by_hand(tmp_path):
    path, data = write_2d(tmp_path)
    source = dfl.io.PatchSource(
        path,
        ["a", "b"],
        "lab",
        patch={"lat": 8, "lon": 8},
        stride={"lat": 5, "lon": 6},
        shuffle=False,
    )
    # the full grid: corners 0, 5, ..., 55 along lat and 0, 6, ..., 36 along lon, C order
    grid = [(i, j) for i in range(0, 57, 5) for j in range(0, 41, 6)]
    assert source.corners.tolist() == [list(c) for c in grid]
    assert source.num_samples == len(grid) and source.corner(3) == grid[3]
    indices, x, y, _ = streamed(source)
    assert indices.tolist() == list(range(len(grid)))
    expected = np.stack([precut(data[k], source.corners, (8, 8), (0, 1)) for k in "ab"], 1)
    assert source.sample_shape == (2, 8, 8) and np.array_equal(x, expected)
    assert np.array_equal(y, precut(data["lab"], source.corners, (8, 8), (0, 1)))
    # a level dim folded into the channels gives the same samples
    folded = dfl.io.PatchSource(
        path,
        "ab",
        "lab",
        patch={"lat": 8, "lon": 8},
        stride={"lat": 5, "lon": 6},
        channels=("level",),
        shuffle=False,
    )
    assert np.array_equal(streamed(folded)[1], expected)
    unfolded = dfl.io.PatchSource(
        path, "ab", patch={1: 8, 2: 8}, stride={1: 5, 2: 6}, shuffle=False
    )
    assert unfolded.sample_shape == (1, 2, 8, 8)
    assert np.array_equal(streamed(unfolded)[1][:, 0], expected)


def test_unshuffled_windows_of_a_3d_volume_stream_in_c_order_as_cut_by_hand(tmp_path):
    path, vol = write_3d(tmp_path)
    source = dfl.io.PatchSource(
        path, patch={0: 12, 1: 12, 2: 12}, stride={0: 9, 1: 8, 2: 7}, shuffle=False
    )
    indices, x, y, _ = streamed(source, batch=5)
    assert y is None and indices.tolist() == list(range(source.num_samples))
    assert source.corners.tolist() == sorted(source.corners.tolist())  # C order
    assert np.array_equal(x[:, 0], precut(vol, source.corners, (12, 12, 12), (0, 1, 2)))
    # only some dims cut: the rest taken whole
    slab = dfl.io.PatchSource(path, patch={2: 10}, stride={2: 3}, shuffle=False)
    assert slab.sample_shape == (1, 40, 36, 10)
    assert np.array_equal(streamed(slab)[1][:, 0], precut(vol, slab.corners, (10,), (2,)))
