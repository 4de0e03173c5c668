"""Batches made of whole chunks, decoded straight into the batch's own buffers.

The chunk reader decodes each chunk into a block of its own, then the assembling thread
copies the batch's rows out of the blocks into the batch (``chunk_reader._gather``). A
batch whose every chunk is new to it, last used by it, and taken whole and in order
into one contiguous run of its rows needs no such copy: each decode thread writes its
chunk straight into the batch's (pinned) buffer at those rows, and the assembly hands the
buffer on. A store of one sample per chunk is always so (a CosmoFlow sample of 4 x 128^3
float32 is 32 MB, one chunk), and there the copy was the most expensive part left on one
thread: 16 samples a step are 540 MB, about 65 ms at the ~8 GB/s one thread copies.
Shuffled batches of many-sample chunks are not so, and are gathered as before.

A source opts in with ``part_layouts()`` (the shape and dtype of one sample of each
array it reads, in its order), ``read_chunks_into(chunks, blocks)`` and
``batch_of(tensors, size)``; ``io.zarr_source.ZarrSource`` does.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from dataflow.core.batch import Batch

Spans = dict[int, tuple[int, int]]  # chunk -> [first, last) rows of the batch it fills


def whole_chunk_spans(
    indices: np.ndarray,
    chunks: np.ndarray,
    touched: Sequence[int],
    new: Sequence[int],
    last_use: dict[int, int],
    position: int,
    index: Any,
) -> Spans | None:
    """Where each chunk of the batch at ``position`` lands in it, if the batch is made of
    whole chunks (each new here, last used here, all its rows in order in one contiguous
    run); else None. ``chunks``: each sample's chunk; ``index``: the source's chunk index."""
    if len(indices) == 0 or list(new) != list(touched):
        return None
    if any(last_use[chunk] != position for chunk in touched):
        return None
    starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]])
    if len(starts) != len(touched):
        return None  # a chunk in two runs
    lengths = np.diff(np.r_[starts, len(chunks)])
    firsts = np.repeat(starts, lengths)  # each row's run start
    if not np.array_equal(index.rows(indices, chunks), np.arange(len(indices)) - firsts):
        return None  # a chunk's rows out of order, or not from its first
    spans: Spans = {}
    for first, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        chunk = int(chunks[first])
        if index.size(chunk) != length:
            return None  # not all of the chunk
        spans[chunk] = (first, first + length)
    return spans


class DirectBatches:
    """The batches of an epoch that are decoded into (:func:`whole_chunk_spans`): each
    one's buffers are taken from ``buffers`` when its first chunk starts decoding, each
    chunk's decode writes into its rows, and :meth:`take` hands the batch on."""

    def __init__(self, source: Any, buffers: Any, sizes: Sequence[int], spans: list[Spans | None]):
        self.source = source
        self.buffers = buffers
        self.sizes = list(sizes)
        self.spans = spans
        self._owner = {c: p for p, s in enumerate(spans) if s is not None for c in s}
        self._layouts: list[tuple[tuple[int, ...], np.dtype]] | None = None
        self._made: dict[int, list[tuple[Any, np.ndarray]]] = {}
        self._lock = threading.Lock()

    def __contains__(self, position: int) -> bool:
        return self.spans[position] is not None

    def owns(self, chunk: int) -> bool:
        return chunk in self._owner

    def blocks(self, chunk: int) -> list[np.ndarray]:
        """Where ``chunk`` decodes: its rows of its batch's buffer, one per array."""
        position = self._owner[chunk]
        with self._lock:  # decode threads may start the same batch at once
            made = self._made.get(position)
            if made is None:
                if self._layouts is None:
                    self._layouts = self.source.part_layouts()
                n = self.sizes[position]
                made = [self.buffers.take(n, shape, dtype) for shape, dtype in self._layouts]
                self._made[position] = made
        first, last = self.spans[position][chunk]
        return [array[first:last] for _, array in made]

    def take(self, position: int, indices: np.ndarray) -> Batch:
        """The batch at ``position``, every chunk of it decoded in place."""
        with self._lock:
            made = self._made.pop(position)
        batch = self.source.batch_of([tensor for tensor, _ in made], len(indices))
        return dataclasses.replace(batch, indices=indices)
