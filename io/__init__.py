"""Data sources for the Load stage: in-memory arrays and zarr stores."""

from dataflow.io.array_source import ArraySource
from dataflow.io.prefetch import Prefetcher
from dataflow.io.sampler import steps_per_epoch
from dataflow.io.sharding import chunk_sizes, replica_streams, shard_epoch
from dataflow.io.writer import to_zarr
from dataflow.io.zarr_source import VariableNotFoundError, ZarrSource

__all__ = [
    "ArraySource",
    "Prefetcher",
    "VariableNotFoundError",
    "ZarrSource",
    "chunk_sizes",
    "replica_streams",
    "shard_epoch",
    "steps_per_epoch",
    "to_zarr",
]
