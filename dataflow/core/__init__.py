"""Layer 0: what every layer shares, importing nothing of dataflow outside this folder.

The values that flow between stages (:mod:`.batch`, :mod:`.step`), phases
(:mod:`.phase`), a replica's window report (:mod:`.window`), the error hierarchy
(:mod:`.errors`), RNG capture (:mod:`.rng`), plain stored values (:mod:`.plain`), the
stage kinds (:mod:`.kinds`) and the contracts between layers (:mod:`.protocols`). io,
ops and stages build on these instead of importing the engine. ``import dataflow.core``
loads neither ``distributed`` nor ``torch``: pure modules (the planner, the driver's
state machine) import from here.
"""

from __future__ import annotations

from typing import Any

from dataflow.core.batch import Batch, ForwardOutput, Gradients
from dataflow.core.errors import (
    BatchSizeError,
    CheckpointError,
    ChunkMissingError,
    ChunkReadError,
    CollectiveError,
    ConfigError,
    DataError,
    DataflowError,
    GraphError,
    IncompatibleCheckpointError,
    LossError,
    ModelError,
    NonFiniteError,
    ReplicaError,
    WorkerLostError,
)
from dataflow.core.phase import PhaseMeasurement, PhaseSpec, lr_at
from dataflow.core.protocols import (
    Balancer,
    ChunkedSource,
    Collective,
    Kernel,
    Schedule,
    Source,
    Stage,
)
from dataflow.core.step import PhaseContext, ReplicaContext, StepContext, StepSpec
from dataflow.core.window import WindowResult

__all__ = [
    "Balancer",
    "Batch",
    "BatchSizeError",
    "CheckpointError",
    "ChunkMissingError",
    "ChunkReadError",
    "ChunkedSource",
    "Collective",
    "CollectiveError",
    "ConfigError",
    "DataError",
    "DataflowError",
    "ForwardOutput",
    "Gradients",
    "GraphError",
    "IncompatibleCheckpointError",
    "Kernel",
    "LossError",
    "ModelError",
    "NonFiniteError",
    "PhaseContext",
    "PhaseMeasurement",
    "PhaseSpec",
    "ReplicaContext",
    "ReplicaError",
    "Schedule",
    "Source",
    "Stage",
    "StepContext",
    "StepSpec",
    "WindowResult",
    "WorkerLostError",
    "capture_rng",
    "lr_at",
    "restore_rng",
]


def __getattr__(name: str) -> Any:
    """``capture_rng`` and ``restore_rng`` need torch: loaded on first use, so importing
    the rest of core stays free of it."""
    if name in ("capture_rng", "restore_rng"):
        from dataflow.core import rng

        return getattr(rng, name)
    raise AttributeError(f"module 'dataflow.core' has no attribute {name!r}")
