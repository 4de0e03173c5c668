"""Data sources for the Load stage: in-memory arrays and zarr stores."""

from dataflow.io.array_source import ArraySource
from dataflow.io.chunk_reader import BatchBuffers, EpochChunkReader
from dataflow.io.labels import LabelError
from dataflow.io.ledger import SampleLedger
from dataflow.io.prefetch import Prefetcher
from dataflow.io.sampler import steps_per_epoch
from dataflow.io.sharding import (
    chunk_sizes,
    continued_streams,
    replica_epochs,
    replica_streams,
    shard_epoch,
    source_chunk_sizes,
)
from dataflow.io.stream import stream_batches
from dataflow.io.writer import to_zarr
from dataflow.io.zarr_source import VariableNotFoundError, ZarrSource

__all__ = [
    "ArraySource",
    "BatchBuffers",
    "EpochChunkReader",
    "LabelError",
    "Prefetcher",
    "SampleLedger",
    "VariableNotFoundError",
    "ZarrSource",
    "chunk_sizes",
    "continued_streams",
    "replica_epochs",
    "replica_streams",
    "shard_epoch",
    "source_chunk_sizes",
    "steps_per_epoch",
    "stream_batches",
    "to_zarr",
]
