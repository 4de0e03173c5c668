"""Batches of whole chunks decoded straight into their buffers (io.direct_batches) are the
batches the gather makes, and only such batches skip it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_corrupt_chunks import chunk_file, damage

import dataflow as dfl
from dataflow.io import chunk_reader as chunk_reader_module
from dataflow.io.batch_buffers import BatchBuffers
from dataflow.io.chunk_index import RunIndex, last_uses
from dataflow.io.direct_batches import whole_chunk_spans


def _spans(batches, sizes, position):
    """whole_chunk_spans of batch ``position`` of ``batches`` over chunks of ``sizes``."""
    index = RunIndex(np.concatenate([[0], np.cumsum(sizes)]))
    chunks = [index.of(np.asarray(b)) for b in batches]
    touched = [np.unique(c).tolist() for c in chunks]
    seen: set[int] = set()
    news = []
    for t in touched:
        news.append([c for c in t if c not in seen])
        seen.update(t)
    b = np.asarray(batches[position])
    return whole_chunk_spans(
        b, chunks[position], touched[position], news[position], last_uses(chunks), position, index
    )


def test_which_batches_are_made_of_whole_chunks():
    ones = [1] * 6  # one sample a chunk: any order is whole chunks
    assert _spans([[4, 1, 3], [0, 5, 2]], ones, 0) == {4: (0, 1), 1: (1, 2), 3: (2, 3)}
    assert _spans([[4, 1, 3], [0, 5, 2]], ones, 1) == {0: (0, 1), 5: (1, 2), 2: (2, 3)}
    threes = [3, 3, 3]  # chunks 0: 0-2, 1: 3-5, 2: 6-8
    assert _spans([[3, 4, 5, 0, 1, 2], [6, 7, 8]], threes, 0) == {1: (0, 3), 0: (3, 6)}
    assert _spans([[3, 4, 5, 0, 1, 2], [6, 7, 8]], threes, 1) == {2: (0, 3)}
    assert _spans([[4, 3, 5], [0, 1, 2, 6, 7, 8]], threes, 0) is None  # rows out of order
    assert _spans([[3, 4], [5, 0, 1, 2]], threes, 0) is None  # part of a chunk
    assert _spans([[3, 4], [5, 0, 1, 2]], threes, 1) is None  # not new here
    assert _spans([[3, 4, 0, 1, 2, 5]], threes, 0) is None  # a chunk in two runs
    assert _spans([[0, 1, 2, 3]], [3, 3], 0) is None  # chunk 1: part, and its last use
    assert _spans([[], [0, 1, 2]], [3], 0) is None  # an empty share


def _one_sample_chunks(tmp_path, n=30, shape=(2, 8, 8)):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = rng.integers(0, 5, n)
    path = tmp_path / "ones.zarr"
    nbytes = int(np.prod(shape)) * 4
    dfl.io.to_zarr(path, x, y, chunk_mb=nbytes / 1e6)
    source = dfl.io.ZarrSource(path, "x", "y")
    assert np.diff(source.chunk_bounds).max() == 1  # one sample a chunk
    return source, x, y


@pytest.mark.parametrize("threads", [1, 3])
def test_whole_chunk_batches_equal_the_gathered_ones_and_skip_the_gather(
    tmp_path, monkeypatch, threads
):
    source, x, y = _one_sample_chunks(tmp_path)
    order = np.random.default_rng(1).permutation(len(x))
    batches = [order[i : i + 7] for i in range(0, len(x), 7)]  # a short last one
    gathered = list(
        dfl.io.EpochChunkReader(source, batches, decode_threads=threads, decode_into_batches=False)
    )
    gathers = []
    original = chunk_reader_module._gather
    monkeypatch.setattr(
        chunk_reader_module, "_gather", lambda *a: gathers.append(1) or original(*a)
    )
    reader = dfl.io.EpochChunkReader(source, batches, decode_threads=threads)
    assert reader.direct is not None
    direct = list(reader)
    assert gathers == []
    for got, want, indices in zip(direct, gathered, batches, strict=True):
        np.testing.assert_array_equal(got.x.numpy(), want.x.numpy())
        np.testing.assert_array_equal(got.x.numpy(), x[indices])
        np.testing.assert_array_equal(got.y.numpy(), y[indices])
        np.testing.assert_array_equal(got.indices, indices)
        assert got.size == len(indices)


def test_a_batch_that_is_not_whole_chunks_is_gathered_beside_whole_ones(tmp_path):
    """Mixed in one epoch: a repeated sample (its chunk in two places) and whole chunks."""
    source, x, _ = _one_sample_chunks(tmp_path, n=12)
    batches = [np.array([3, 5, 3]), np.array([0, 1, 2]), np.array([4, 6, 7, 8])]
    reader = dfl.io.EpochChunkReader(source, batches, decode_threads=2)
    assert [p in reader.direct for p in range(3)] == [False, True, True]
    for got, indices in zip(reader, batches, strict=True):
        np.testing.assert_array_equal(got.x.numpy(), x[indices])


def test_a_damaged_chunk_in_a_whole_chunk_batch_is_named(tmp_path):
    source, _, _ = _one_sample_chunks(tmp_path, n=12, shape=(4, 8, 8))
    victim = chunk_file(tmp_path / "ones.zarr", "x", 5, 3)
    damage(victim)
    batches = [np.arange(0, 6), np.arange(6, 12)]
    reader = dfl.io.EpochChunkReader(source, batches, decode_threads=2)
    assert reader.direct is not None and 0 in reader.direct
    with pytest.raises(dfl.ChunkReadError, match=r"chunk 'x/c/5/0/0/0'.*checksum does not match"):
        list(reader)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_whole_chunk_batches_land_in_pinned_memory_as_the_gathered_ones_do(tmp_path):
    """On a GPU the batches are assembled in page-locked memory for the side-stream copy:
    decoded into, they must be too."""
    source, x, _ = _one_sample_chunks(tmp_path, n=16, shape=(4, 16, 16))
    batches = [np.arange(0, 8), np.arange(8, 16)]
    reader = dfl.io.EpochChunkReader(
        source, batches, buffers=BatchBuffers(pin_memory=True), decode_threads=3
    )
    assert reader.direct is not None
    for got, indices in zip(reader, batches, strict=True):
        assert got.x.is_pinned() and got.y.is_pinned()
        np.testing.assert_array_equal(got.x.numpy(), x[indices])
