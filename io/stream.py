"""One epoch of shuffled batches from a source, outside the engine.

The same path the Load stage takes (chunk-order shuffle, shuffle buffer, each
chunk decoded once, a background reader ``prefetch`` batches ahead), for one
reader: to inspect a store, evaluate a model, or measure read speed
(``benchmarks/bench_streaming.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dataflow.errors import ConfigError
from dataflow.io.chunk_reader import EpochChunkReader, is_chunked
from dataflow.io.prefetch import Prefetcher
from dataflow.io.sharding import DEFAULT_BUFFER_CHUNKS, shard_epoch, source_chunk_sizes
from dataflow.stages.base import Batch


def stream_batches(
    source: Any,
    batch_size: int,
    *,
    epoch: int = 0,
    seed: int = 0,
    buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
    prefetch: int = 2,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Yield the batches of one epoch of ``source``; ``batch.indices`` says which samples."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"stream_batches(batch_size={batch_size!r}): must be an int >= 1")
    total = source.num_samples
    used = total - total % batch_size if drop_last else total
    [order] = shard_epoch(
        source_chunk_sizes(source),
        [used],
        seed=seed,
        epoch=epoch,
        shuffle=getattr(source, "shuffle", True),
        buffer_chunks=buffer_chunks,
    )
    batches = [order[i : i + batch_size] for i in range(0, used, batch_size)]

    def produce() -> Iterator[Batch]:
        if is_chunked(source):
            reader = EpochChunkReader(source, batches)
            for batch, indices in zip(reader, batches, strict=True):
                batch.indices = indices
                yield batch
        else:
            yield from (source.read(indices) for indices in batches)

    prefetcher = Prefetcher(lambda batch: batch, produce(), depth=prefetch)
    try:
        while True:
            try:
                yield prefetcher.get()
            except StopIteration:
                return
    finally:
        prefetcher.close()
