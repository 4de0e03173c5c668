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
