"""Data sources for the Load stage: in-memory arrays and zarr stores.

Each name is imported on first use (PEP 562): the pure modules that need only the
sampler or the sharding (the planner, the schedules, the driver's state machine)
import ``dataflow.io.sampler`` without loading torch or zarr through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ArraySource": "dataflow.io.array_source",
    "BatchBuffers": "dataflow.io.batch_buffers",
    "EpochChunkReader": "dataflow.io.chunk_reader",
    "LabelError": "dataflow.io.labels",
    "NormalizationStats": "dataflow.io.normalization",
    "normalization_stats": "dataflow.io.normalization",
    "PatchSource": "dataflow.io.patch_source",
    "SampleLedger": "dataflow.io.ledger",
    "Prefetcher": "dataflow.io.prefetch",
    "steps_per_epoch": "dataflow.io.sampler",
    "chunk_sizes": "dataflow.io.sharding",
    "continued_streams": "dataflow.io.sharding",
    "replica_epochs": "dataflow.io.sharding",
    "replica_streams": "dataflow.io.sharding",
    "shard_epoch": "dataflow.io.sharding",
    "source_chunk_members": "dataflow.io.sharding",
    "source_chunk_sizes": "dataflow.io.sharding",
    "stream_batches": "dataflow.io.stream",
    "to_zarr": "dataflow.io.writer",
    "verify_store": "dataflow.io.verify",
    "VariableNotFoundError": "dataflow.io.zarr_source",
    "ZarrSource": "dataflow.io.zarr_source",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dataflow.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
