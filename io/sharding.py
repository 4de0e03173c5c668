"""Chunk-aware sharding of an epoch over replicas (a pure function).

The building block of streaming from chunked stores (issue 3): not yet wired into
``stages.Load``, which still slices ``epoch_order`` per step.

One epoch, in two shuffle levels seeded by (seed, epoch):

1. the chunks are put in a random order, and that sequence of samples is cut into
   consecutive segments, one per replica, of the lengths the plan gives each
   replica for the epoch (``n_r = sum of its local batches``). A replica therefore
   reads whole chunks, except at most one chunk at each boundary between two
   replicas: at most ``W - 1`` chunks per epoch are decoded twice, whatever ``W``.
2. within each replica's segment, samples are permuted inside consecutive groups of
   ``buffer_chunks`` chunks' worth of samples: a shuffle buffer that needs only
   those chunks in memory, whatever the dataset size.

Replica ``r`` then takes the next ``b_r`` samples of its stream at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dataflow.errors import ConfigError


def chunk_sizes(num_samples: int, chunk_samples: int) -> list[int]:
    """Samples per chunk along the sample dimension (the last chunk may be short)."""
    if num_samples < 0 or chunk_samples < 1:
        raise ConfigError(
            f"chunk_sizes: need num_samples >= 0 and chunk_samples >= 1, got "
            f"{num_samples} and {chunk_samples}"
        )
    full, rest = divmod(num_samples, chunk_samples)
    return [chunk_samples] * full + ([rest] if rest else [])


def shard_epoch(
    sizes: Sequence[int],
    replica_samples: Sequence[int],
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    buffer_chunks: int = 4,
) -> list[np.ndarray]:
    """Each replica's sample indices for one epoch, in the order it reads them.

    ``sizes``: samples per chunk, in store order. ``replica_samples``: how many
    samples each replica consumes this epoch; their sum may be less than the
    dataset (``drop_last``): the samples left over at the end go unused.
    """
    total = int(sum(sizes))
    if sum(replica_samples) > total or any(n < 0 for n in replica_samples):
        raise ConfigError(
            f"shard_epoch: replicas want {list(replica_samples)} samples "
            f"(sum {sum(replica_samples)}) from {total}; each share must be >= 0 and the sum "
            "at most the dataset"
        )
    if buffer_chunks < 1:
        raise ConfigError(f"shard_epoch: buffer_chunks must be >= 1, got {buffer_chunks}")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    order = rng.permutation(len(sizes)) if shuffle else np.arange(len(sizes))
    stream = (
        np.concatenate([np.arange(starts[c], starts[c] + sizes[c]) for c in order])
        if len(sizes)
        else np.empty(0, np.int64)
    )
    group = buffer_chunks * (max(sizes) if len(sizes) else 1)
    shards, offset = [], 0
    for rank, n in enumerate(replica_samples):
        segment = stream[offset : offset + n].copy()
        offset += n
        if shuffle:
            local = np.random.default_rng([int(seed), int(epoch), rank])
            for lo in range(0, n, group):
                local.shuffle(segment[lo : lo + group])
        shards.append(segment)
    return shards
