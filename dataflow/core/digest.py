"""A digest of sample indices: what a replica reports instead of the indices.

The driver knows from the plan which samples each replica reads at each step, so
the replica only proves it read them: the digest of a set of indices is the sum
(mod 2**64) of a mixing hash of each index. It is additive, so the driver checks a
whole window of every replica with one sum over the planned indices, and
order-free, so prefetching order does not matter. A lost, repeated or wrong sample
changes it (collisions are as rare as in a 64-bit hash).
"""

from __future__ import annotations

import numpy as np

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (Fibonacci hashing)
_SHIFT = np.uint64(29)


def index_hashes(indices: np.ndarray) -> np.ndarray:
    """The per-index hash (uint64) the digest sums; wraps around by design."""
    x = np.asarray(indices, dtype=np.int64).astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        x = x * _MULTIPLIER
        return x ^ (x >> _SHIFT)


def sample_digest(indices: np.ndarray | None) -> int:
    """The digest of ``indices`` (0 for none)."""
    if indices is None or len(indices) == 0:
        return 0
    with np.errstate(over="ignore"):
        return int(index_hashes(indices).sum(dtype=np.uint64))


def add_digests(a: int, b: int) -> int:
    return (a + b) % (1 << 64)
