"""dataflow: CNN training as a task graph on a Dask cluster.

import dataflow as dfl
pipe = dfl.Pipeline(model=Net, loss=F.cross_entropy,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    source=dfl.io.ArraySource(x, y),
                    schedule=dfl.schedule.Fixed(64))
result = pipe.fit(epochs=5)          # an embedded LocalCluster
"""

import importlib
from typing import Any

from dataflow.core.errors import (
    BatchSizeError,
    CallbackError,
    ChunkMissingError,
    ChunkReadError,
    CollectiveError,
    ConfigError,
    DataError,
    DataflowError,
    GraphError,
    LossError,
    ModelError,
    NonFiniteError,
    ReplicaError,
    StoreAccessError,
    StoreUnavailableError,
    WorkerLostError,
)

# Imported on first use (PEP 562), so that the pure modules (the planner, the balancer,
# the schedules, the driver's state machine) import without torch.distributed or Dask.
_LAZY = {
    "EarlyStopping": "dataflow.callbacks",
    "Graph": "dataflow.graph",
    "KeepBest": "dataflow.callbacks",
    "Layout": "dataflow.planning.layout",
    "Node": "dataflow.graph",
    "FitResult": "dataflow.history",
    "History": "dataflow.history",
    "Pipeline": "dataflow.pipeline",
    "Plan": "dataflow.planning.plan",
    "NoisyNeighbour": "dataflow.runtime.throttle",
    "SlowdownSchedule": "dataflow.runtime.throttle",
    "StopTraining": "dataflow.callbacks",
    "Trainer": "dataflow.trainer",
    "TrainerConfig": "dataflow.trainer",
}
_SUBMODULES = {  # the public subpackages, at their homes
    "balance": "dataflow.schedule.balance",
    "checkpoint": "dataflow.checkpoint",
    "costmodel": "dataflow.costmodel",
    "errors": "dataflow.errors",
    "io": "dataflow.io",
    "ops": "dataflow.ops",
    "schedule": "dataflow.schedule",
    "spatial": "dataflow.spatial",
    "stages": "dataflow.stages",
    "sync": "dataflow.sync",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'dataflow' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "BatchSizeError",
    "CallbackError",
    "ChunkMissingError",
    "ChunkReadError",
    "CollectiveError",
    "ConfigError",
    "DataError",
    "DataflowError",
    "EarlyStopping",
    "FitResult",
    "Graph",
    "GraphError",
    "History",
    "KeepBest",
    "Layout",
    "LossError",
    "ModelError",
    "Node",
    "NoisyNeighbour",
    "NonFiniteError",
    "Pipeline",
    "Plan",
    "ReplicaError",
    "SlowdownSchedule",
    "StopTraining",
    "StoreAccessError",
    "StoreUnavailableError",
    "Trainer",
    "TrainerConfig",
    "WorkerLostError",
    "balance",
    "costmodel",
    "errors",
    "io",
    "ops",
    "schedule",
    "stages",
    "sync",
]
