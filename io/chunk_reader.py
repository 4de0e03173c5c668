"""Turn one replica's epoch of batches into chunk reads: each chunk decoded once.

A chunked source (zarr, dask) decodes whole chunks whatever a read asks for, so
reading batch by batch would decode a chunk once for every batch that touches
it. The whole epoch's batches are known in advance (``io.sharding``), so this
reader knows each chunk's last use: it decodes a chunk the first time a batch
needs it, keeps the decoded chunk while later batches still need it, and drops
it after its last use. Memory is the chunks live at once, which the shuffle
buffer bounds (about ``buffer_chunks`` chunks plus the ones the current batch
spans), whatever the dataset size.

Before the first batch, every chunk of the epoch is checked to exist, so a
missing chunk fails the epoch before any step trains on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from dataflow.stages.base import Batch


class ChunkedSource(Protocol):
    """A source whose storage unit is a run of consecutive samples (a chunk)."""

    @property
    def chunk_bounds(self) -> np.ndarray:
        """``C + 1`` sample offsets: chunk ``c`` holds samples ``[b[c], b[c+1])``."""
        ...

    def check_chunks(self, chunks: Sequence[int]) -> None:
        """Raise ``ChunkMissingError`` if any of ``chunks`` is absent from the store."""
        ...

    def read_chunks(self, chunks: Sequence[int]) -> dict[int, Batch]:
        """Decode ``chunks``; each value holds that chunk's samples, sample dim first."""
        ...

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices`` (used here only for an empty batch)."""
        ...


def is_chunked(source: Any) -> bool:
    return all(hasattr(source, name) for name in ("chunk_bounds", "check_chunks", "read_chunks"))


def chunk_of(bounds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The chunk holding each sample index."""
    return np.searchsorted(bounds, indices, side="right") - 1


def last_uses(chunks_per_batch: Sequence[np.ndarray]) -> dict[int, int]:
    """For every chunk the batches touch, the position of the last batch touching it."""
    last: dict[int, int] = {}
    for position, chunks in enumerate(chunks_per_batch):
        for chunk in np.unique(chunks).tolist():
            last[chunk] = position
    return last


def _gather(values: list[Any], rows: list[np.ndarray], positions: list[np.ndarray], n: int) -> Any:
    """Rows ``rows[i]`` of chunk value ``values[i]`` placed at ``positions[i]`` of a batch."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, tuple):
        return tuple(_gather([v[k] for v in values], rows, positions, n) for k in range(len(first)))
    out = torch.empty((n, *first.shape[1:]), dtype=first.dtype)
    for value, local, where in zip(values, rows, positions, strict=True):
        out[torch.from_numpy(where)] = value[torch.from_numpy(local)]
    return out


class EpochChunkReader:
    """Yields the batches of one replica's epoch, decoding each chunk once."""

    def __init__(self, source: ChunkedSource, batches: Sequence[np.ndarray]) -> None:
        self.source = source
        self.batches = [np.asarray(b, dtype=np.int64).reshape(-1) for b in batches]
        self.bounds = np.asarray(source.chunk_bounds, dtype=np.int64)
        self.chunks = [chunk_of(self.bounds, indices) for indices in self.batches]
        self.last_use = last_uses(self.chunks)
        self.decoded = 0  # chunks decoded so far: the test of "once per epoch"
        self.peak_live_samples = 0  # most decoded samples held at once: the memory bound

    def __iter__(self) -> Iterator[Batch]:
        self.source.check_chunks(sorted(self.last_use))
        live: dict[int, Batch] = {}
        for position, (indices, chunks) in enumerate(zip(self.batches, self.chunks, strict=True)):
            touched = np.unique(chunks).tolist()
            new = [c for c in touched if c not in live]
            if new:
                live.update(self.source.read_chunks(new))
                self.decoded += len(new)
            held = sum(int(self.bounds[c + 1] - self.bounds[c]) for c in live)
            self.peak_live_samples = max(self.peak_live_samples, held)
            yield self._assemble(indices, chunks, touched, live)
            for chunk in touched:
                if self.last_use[chunk] == position:
                    del live[chunk]

    def _assemble(
        self, indices: np.ndarray, chunks: np.ndarray, touched: list[int], live: dict[int, Batch]
    ) -> Batch:
        rows, positions, parts = [], [], []
        for chunk in touched:
            where = np.flatnonzero(chunks == chunk)
            rows.append(indices[where] - self.bounds[chunk])
            positions.append(where)
            parts.append(live[chunk])
        n = len(indices)
        if n == 0:  # a replica with no share this step: the source's own empty batch
            return self.source.read(indices)
        x = _gather([p.x for p in parts], rows, positions, n)
        y = _gather([p.y for p in parts], rows, positions, n)
        return Batch(x=x, y=y, size=n, indices=indices)
