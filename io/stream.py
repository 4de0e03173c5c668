"""One epoch of shuffled batches from a source, outside the engine.

The same path the Load stage takes (chunk-order shuffle, shuffle buffer, each
chunk decoded once, a background reader ``prefetch`` batches ahead), for one
reader: to inspect a store, evaluate a model, or measure read speed
(``benchmarks/bench_streaming.py``).

A batch's tensors live in a reused output buffer that is handed out again only
once nothing refers to the batch, or to any view or array made from it
(``io.batch_buffers.BatchBuffers``): keeping batches (``list(stream_batches(...))``)
is safe, and dropping each one after use lets the next reuse its memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dataflow.core.batch import Batch
from dataflow.core.errors import ConfigError
from dataflow.io.batch_buffers import BatchBuffers
from dataflow.io.chunk_index import is_chunked
from dataflow.io.chunk_reader import (
    EpochChunkReader,
    check_decode_threads,
)
from dataflow.io.prefetch import Prefetcher
from dataflow.io.sharding import (
    DEFAULT_BUFFER_CHUNKS,
    shard_epoch,
    source_chunk_groups,
    source_chunk_members,
    source_chunk_sizes,
)

# Output buffers kept beyond ``prefetch``: the batch being assembled, the one the
# consumer holds, and one each the loader thread and the generator hand on.
BUFFER_SLACK = 4


def stream_batches(
    source: Any,
    batch_size: int,
    *,
    epoch: int = 0,
    seed: int = 0,
    buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
    prefetch: int = 2,
    drop_last: bool = False,
    decode_ahead: int | None = None,
    decode_threads: int | str = "auto",
) -> Iterator[Batch]:
    """Yield the batches of one epoch of ``source``; ``batch.indices`` says which samples.

    ``prefetch``: batches assembled ahead (a background thread). Chunked sources:
    ``decode_ahead``: batches whose new chunks are decoded ahead of the assembly (None:
    1 with one decode thread, 2 with several); ``decode_threads``: the threads decoding
    them (``"auto"``: min(4, torch's threads here)); the batches are the same whatever
    the thread count.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"stream_batches(batch_size={batch_size!r}): must be an int >= 1")
    check_decode_threads("stream_batches", decode_threads)
    total = source.num_samples
    used = total - total % batch_size if drop_last else total
    [order] = shard_epoch(
        source_chunk_sizes(source),
        [used],
        seed=seed,
        epoch=epoch,
        shuffle=getattr(source, "shuffle", True),
        buffer_chunks=buffer_chunks,
        members=source_chunk_members(source),
        groups=source_chunk_groups(source),
    )
    batches = [order[i : i + batch_size] for i in range(0, used, batch_size)]

    def produce() -> Iterator[Batch]:
        if is_chunked(source):
            buffers = BatchBuffers(keep=prefetch + BUFFER_SLACK)
            yield from EpochChunkReader(
                source,
                batches,
                buffers=buffers,
                decode_ahead=decode_ahead,
                decode_threads=decode_threads,
            )
        else:
            for indices in batches:
                batch = source.read(indices)
                batch.indices = indices
                yield batch
                del batch

    prefetcher = Prefetcher(lambda batch: batch, produce(), depth=prefetch)
    try:
        while True:
            try:
                yield prefetcher.get()
            except StopIteration:
                return
    finally:
        prefetcher.close()
