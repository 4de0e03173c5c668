"""The public name of the error hierarchy, which lives in :mod:`dataflow.core.errors`.

Kept so ``from dataflow.errors import ConfigError`` goes on working for users;
code inside the package imports from ``dataflow.core.errors``.
"""

from __future__ import annotations

from dataflow.core.errors import (
    BatchSizeError,
    CallbackError,
    CheckpointError,
    ChunkMissingError,
    ChunkReadError,
    CollectiveError,
    ConfigError,
    DataError,
    DataflowError,
    FitStopped,
    GraphError,
    IncompatibleCheckpointError,
    LossError,
    ModelError,
    NonFiniteError,
    ReplicaError,
    StoreAccessError,
    StoreUnavailableError,
    WorkerLostError,
)

__all__ = [
    "BatchSizeError",
    "CallbackError",
    "CheckpointError",
    "ChunkMissingError",
    "ChunkReadError",
    "CollectiveError",
    "ConfigError",
    "DataError",
    "DataflowError",
    "FitStopped",
    "GraphError",
    "IncompatibleCheckpointError",
    "LossError",
    "ModelError",
    "NonFiniteError",
    "ReplicaError",
    "StoreAccessError",
    "StoreUnavailableError",
    "WorkerLostError",
]
