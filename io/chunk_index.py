"""Which chunk holds which sample, and where in its decoded batch: the lookups the
chunk reader (``io.chunk_reader``) plans an epoch's reads with.

A chunk is a run of consecutive samples (``chunk_bounds``: found by a binary search,
:class:`RunIndex`) or any set of them (``chunk_members``, a ``PatchSource``'s blocks of
windows: found through two lookup arrays, :class:`MemberIndex`, built once per source).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError
from dataflow.core.protocols import ChunkedSource


def is_chunked(source: Any) -> bool:
    """Whether ``source`` reads whole chunks (:class:`dataflow.core.protocols.ChunkedSource`:
    ``check_chunks``, ``read_chunks`` and its chunks as ``chunk_bounds`` or
    ``chunk_members``)."""
    if not isinstance(source, ChunkedSource):
        return False
    return getattr(source, "chunk_members", None) is not None or hasattr(source, "chunk_bounds")


def chunk_of(bounds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The chunk holding each sample index."""
    return np.searchsorted(bounds, indices, side="right") - 1


class RunIndex:
    """Where a sample lies when chunk ``c`` is the run ``[bounds[c], bounds[c+1])``."""

    def __init__(self, bounds: Any) -> None:
        self.bounds = np.asarray(bounds, dtype=np.int64)

    def of(self, indices: np.ndarray) -> np.ndarray:
        """The chunk holding each sample index."""
        return chunk_of(self.bounds, indices)

    def rows(self, indices: np.ndarray, chunk: int) -> np.ndarray:
        """The position of each of ``indices`` (all in ``chunk``) in its decoded batch."""
        return indices - self.bounds[chunk]

    def size(self, chunk: int) -> int:
        return int(self.bounds[chunk + 1] - self.bounds[chunk])


class MemberIndex:
    """Where a sample lies when chunk ``c`` holds the samples ``members[c]`` (sorted), and
    its decoded batch holds them in that order: two lookup arrays, built once."""

    def __init__(self, members: Sequence[np.ndarray]) -> None:
        sizes = np.array([len(m) for m in members], dtype=np.int64)
        total = int(sizes.sum())
        flat = np.concatenate([np.asarray(m, dtype=np.int64) for m in members] or [np.empty(0)])
        flat = flat.astype(np.int64)
        self.sizes = sizes
        self.owner = np.full(total, -1, dtype=np.int64)
        if total and (flat.min() < 0 or flat.max() >= total):
            raise ConfigError(
                f"chunk_members: sample indices must lie in [0, {total}), got "
                f"{flat.min()}..{flat.max()}; the chunks' members must partition the samples"
            )
        self.owner[flat] = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        if (self.owner < 0).any():
            raise ConfigError(
                f"chunk_members: sample {int(np.argmax(self.owner < 0))} is in no chunk (or "
                "another is in two); the chunks' members must partition the samples"
            )
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.slot = np.empty(total, dtype=np.int64)
        self.slot[flat] = np.arange(total, dtype=np.int64) - np.repeat(starts, sizes)

    def of(self, indices: np.ndarray) -> np.ndarray:
        return self.owner[indices]

    def rows(self, indices: np.ndarray, chunk: int) -> np.ndarray:
        return self.slot[indices]

    def size(self, chunk: int) -> int:
        return int(self.sizes[chunk])


MEMBER_INDEX = "_member_index"  # where a source keeps its MemberIndex (not pickled)


def chunk_index(source: Any) -> RunIndex | MemberIndex:
    """How ``source``'s samples map to its chunks: its ``chunk_members`` (lookup arrays
    built once per source object and kept on it, as ``_member_index``, which its
    pickling leaves out), else its ``chunk_bounds``."""
    members = getattr(source, "chunk_members", None)
    if members is None:
        return RunIndex(source.chunk_bounds)
    kept = getattr(source, "__dict__", None)
    if kept is None:  # (no instance dict: built per reader)
        return MemberIndex(members)
    index = kept.get(MEMBER_INDEX)
    if index is None:
        index = kept[MEMBER_INDEX] = MemberIndex(members)
    return index


def last_uses(chunks_per_batch: Sequence[np.ndarray]) -> dict[int, int]:
    """For every chunk the batches touch, the position of the last batch touching it."""
    last: dict[int, int] = {}
    for position, chunks in enumerate(chunks_per_batch):
        for chunk in np.unique(chunks).tolist():
            last[chunk] = position
    return last
