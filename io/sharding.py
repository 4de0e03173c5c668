"""Chunk-aware sharding of an epoch over replicas (a pure function).

``stages.Load`` reads through :func:`replica_streams`; an in-memory source is the
case of one sample per chunk.

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

A chunk is a run of consecutive samples (``sizes``), or any set of samples
(``members``: the windows of a ``PatchSource`` block, which are not consecutive in
C order); the stream is then the chunks' member lists, concatenated in the
shuffled chunk order, and level 2 is the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from dataflow.core.errors import ConfigError
from dataflow.core.step import StepSpec

DEFAULT_BUFFER_CHUNKS = 4


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
    members: Sequence[np.ndarray] | None = None,
    groups: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Each replica's sample indices for one epoch, in the order it reads them.

    ``sizes``: samples per chunk, in store order. ``replica_samples``: how many
    samples each replica consumes this epoch; their sum may be less than the
    dataset (``drop_last``): the samples left over at the end go unused.
    ``members``: the sample indices each chunk holds, when a chunk is not a run of
    consecutive samples (``ChunkedSource.chunk_members``, e.g. the windows of a block);
    None: chunk ``c`` holds the ``sizes[c]`` samples after those of chunk ``c - 1``.
    ``groups``: a group id per chunk (``chunk_groups``, e.g. neighbouring blocks of
    windows sharing storage chunks): shuffled, the groups come in a random order and
    the chunks of a group follow each other in a random order (so a chunk cache finds
    what the group's previous chunks decoded); None: chunks in a random order.
    """
    if members is not None and [len(m) for m in members] != [int(n) for n in sizes]:
        raise ConfigError(
            f"shard_epoch: {len(members)} chunk member lists do not match the {len(sizes)} "
            "chunk sizes; pass sizes=[len(m) for m in members]"
        )
    total = int(sum(sizes))
    if sum(replica_samples) > total or any(n < 0 for n in replica_samples):
        raise ConfigError(
            f"shard_epoch: replicas want {list(replica_samples)} samples "
            f"(sum {sum(replica_samples)}) from {total}; each share must be >= 0 and the sum "
            "at most the dataset"
        )
    if buffer_chunks < 1:
        raise ConfigError(f"shard_epoch: buffer_chunks must be >= 1, got {buffer_chunks}")
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes_arr)[:-1]]).astype(np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    order = rng.permutation(len(sizes_arr)) if shuffle else np.arange(len(sizes_arr))
    if shuffle and groups is not None and len(sizes_arr):  # groups in a random order,
        group_of = np.asarray(groups, dtype=np.int64)  # then their chunks in a random order
        rank = np.random.default_rng([int(seed), int(epoch), 2**31]).permutation(
            int(group_of.max()) + 1
        )
        order = order[np.argsort(rank[group_of[order]], kind="stable")]
    # Vectorised: position p of the stream holds sample start(chunk) + (p - where chunk begins).
    placed = np.concatenate([[0], np.cumsum(sizes_arr[order])[:-1]]).astype(np.int64)
    stream = np.arange(total, dtype=np.int64) + np.repeat(starts[order] - placed, sizes_arr[order])
    if members is not None:  # the same positions, in the chunks' concatenated member lists
        flat = np.concatenate([np.asarray(m, dtype=np.int64) for m in members] or [stream[:0]])
        stream = flat[stream]
    group = buffer_chunks * (int(sizes_arr.max()) if len(sizes_arr) else 1)
    shards, offset = [], 0
    for rank, n in enumerate(replica_samples):
        segment = stream[offset : offset + n]
        offset += n
        if shuffle and n:  # permute within each group: random keys, sorted per group
            keys = np.random.default_rng([int(seed), int(epoch), rank]).random(n)
            segment = segment[np.lexsort((keys, np.arange(n) // group))]
        shards.append(segment.copy())
    return shards


def source_chunk_sizes(source: object) -> list[int]:
    """Samples per chunk of a source: the lengths of its ``chunk_members`` if it has them
    (windows grouped by block), its ``chunk_bounds`` if it has them (zarr, dask: possibly
    irregular), else ``chunk_samples`` per chunk (1 for in-memory arrays)."""
    members = source_chunk_members(source)
    if members is not None:
        return [len(m) for m in members]
    bounds = getattr(source, "chunk_bounds", None)
    if bounds is not None:
        return np.diff(np.asarray(bounds, dtype=np.int64)).tolist()
    return chunk_sizes(source.num_samples, getattr(source, "chunk_samples", 1))


def source_chunk_groups(source: object) -> list[int] | None:
    """A group id per chunk of a source whose shuffled order keeps neighbouring chunks
    together (``chunk_groups``); None for every other source."""
    groups = getattr(source, "chunk_groups", None)
    return None if groups is None else [int(g) for g in groups]


def source_chunk_members(source: object) -> list[np.ndarray] | None:
    """The sample indices each chunk of a source holds, when its chunks are not runs of
    consecutive samples (``chunk_members``); None for every source whose chunks are."""
    members = getattr(source, "chunk_members", None)
    return None if members is None else list(members)


def continued_streams(
    streams: Sequence[np.ndarray],
    earlier_splits: Sequence[tuple[Sequence[int], Sequence[int]]],
    wanted: Sequence[int],
) -> list[np.ndarray]:
    """An epoch re-split mid-way: what is left of each replica's stream under each
    earlier split (``(given, consumed)`` per replica), concatenated in replica order,
    cut into consecutive segments of ``wanted`` samples.

    ``streams`` are the epoch's streams under the first split. Concatenating the
    remainders keeps each chunk's samples together, and no sample is given twice:
    the remainders are disjoint and the consumed prefixes are left out.
    """
    current = [np.asarray(s, dtype=np.int64) for s in streams]
    for level, (given, consumed) in enumerate(earlier_splits):
        lengths = [len(s) for s in current]
        if list(given) != lengths or any(
            not 0 <= c <= n for c, n in zip(consumed, lengths, strict=True)
        ):
            raise ConfigError(
                f"continued_streams: split {level} gave {list(given)} and consumed "
                f"{list(consumed)}, but the streams hold {lengths} samples"
            )
        rest = np.concatenate([s[c:] for s, c in zip(current, consumed, strict=True)])
        sizes = list(earlier_splits[level + 1][0]) if level + 1 < len(earlier_splits) else wanted
        if sum(sizes) > len(rest):
            raise ConfigError(
                f"continued_streams: {len(rest)} samples left in the epoch, the next split "
                f"wants {list(sizes)}"
            )
        bounds = np.cumsum([0, *sizes])
        current = [rest[a:b] for a, b in itertools.pairwise(bounds)]
    return current


def epoch_streams(
    steps: Sequence[StepSpec],
    *,
    sizes: Sequence[int],
    seed: int,
    shuffle: bool = True,
    buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
    members: Sequence[np.ndarray] | None = None,
    groups: Sequence[int] | None = None,
) -> Iterator[tuple[int, list[StepSpec], list[np.ndarray]]]:
    """Per epoch of ``steps`` (whole epochs, or the rest of an epoch after a re-split,
    in order): the epoch, its steps, and every replica's stream of sample indices for
    those steps. Replica ``r`` reads its stream in order, ``local_batches[r]`` samples
    per step, so the samples a replica consumed are always a prefix of its stream."""
    for (epoch, earlier), group in itertools.groupby(
        steps, key=lambda spec: (spec.epoch, spec.earlier_splits)
    ):
        epoch_steps = list(group)
        # each replica's samples in these steps (steps x replicas, summed in numpy: a
        # phase of 1,024 replicas would be a million Python additions)
        per_step = np.asarray([spec.local_batches for spec in epoch_steps], dtype=np.int64)
        wanted = per_step.sum(axis=0).tolist()
        first = list(earlier[0][0]) if earlier else wanted
        streams = shard_epoch(
            sizes,
            first,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            buffer_chunks=buffer_chunks,
            members=members,
            groups=groups,
        )
        if earlier:
            streams = continued_streams(streams, earlier, wanted)
        yield epoch, epoch_steps, [s[:want] for s, want in zip(streams, wanted, strict=True)]


def replica_epochs(
    steps: Sequence[StepSpec],
    *,
    sizes: Sequence[int],
    seed: int,
    shuffle: bool = True,
    buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
    members: Sequence[np.ndarray] | None = None,
    groups: Sequence[int] | None = None,
) -> Iterator[tuple[int, list[StepSpec], list[list[np.ndarray]]]]:
    """Per epoch of ``steps`` (see :func:`epoch_streams`): the epoch, its steps, and for
    every step every replica's sample indices (``parts[step][replica]``).

    Replica ``r`` takes the next ``local_batches[r]`` samples of its epoch stream at
    each step, so batches have exactly the planned sizes across chunk boundaries.
    """
    for epoch, epoch_steps, streams in epoch_streams(
        steps,
        sizes=sizes,
        seed=seed,
        shuffle=shuffle,
        buffer_chunks=buffer_chunks,
        members=members,
        groups=groups,
    ):
        position = [0] * len(streams)
        parts = []
        for spec in epoch_steps:
            step_parts = []
            for r, size in enumerate(spec.local_batches):
                step_parts.append(streams[r][position[r] : position[r] + size])
                position[r] += size
            parts.append(step_parts)
        yield epoch, epoch_steps, parts


def replica_streams(
    steps: Sequence[StepSpec],
    *,
    num_samples: int | None = None,
    chunk_samples: int = 1,
    sizes: Sequence[int] | None = None,
    seed: int,
    shuffle: bool = True,
    buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
    members: Sequence[np.ndarray] | None = None,
    groups: Sequence[int] | None = None,
) -> Iterator[tuple[StepSpec, list[np.ndarray]]]:
    """For each step (whole epochs, in order): every replica's sample indices.

    Chunks are ``sizes`` (samples per chunk, possibly irregular) or ``num_samples``
    cut into chunks of ``chunk_samples``. The concatenation over replicas is the
    step's global batch: a single process that trains on those batches computes
    the same mean gradients.
    """
    if sizes is None and members is not None:
        sizes = [len(m) for m in members]
    if sizes is None:
        if num_samples is None:
            raise ConfigError("replica_streams: give sizes= or num_samples=")
        sizes = chunk_sizes(num_samples, chunk_samples)
    for _, epoch_steps, parts in replica_epochs(
        steps,
        sizes=sizes,
        seed=seed,
        shuffle=shuffle,
        buffer_chunks=buffer_chunks,
        members=members,
        groups=groups,
    ):
        yield from zip(epoch_steps, parts, strict=True)
