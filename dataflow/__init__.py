"""dataflow: CNN training as a task graph on a Dask cluster.

import dataflow as dfl
pipe = dfl.Pipeline(model=Net, loss=F.cross_entropy,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    source=dfl.io.ArraySource(x, y),
                    schedule=dfl.schedule.Fixed(64))
result = pipe.fit(epochs=5)          # an embedded LocalCluster
"""

from dataflow import balance, errors, schedule
from dataflow import io as io
from dataflow import ops as ops
from dataflow import stages as stages
from dataflow.errors import (
    BatchSizeError,
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
    WorkerLostError,
)
from dataflow.graph import Graph, Node
from dataflow.history import FitResult, History
from dataflow.pipeline import Pipeline
from dataflow.plan import Plan
from dataflow.trainer import Trainer, TrainerConfig

__version__ = "0.1.0"

__all__ = [
    "BatchSizeError",
    "ChunkMissingError",
    "ChunkReadError",
    "CollectiveError",
    "ConfigError",
    "DataError",
    "DataflowError",
    "FitResult",
    "Graph",
    "GraphError",
    "History",
    "LossError",
    "ModelError",
    "Node",
    "NonFiniteError",
    "Pipeline",
    "Plan",
    "ReplicaError",
    "Trainer",
    "TrainerConfig",
    "WorkerLostError",
    "balance",
    "errors",
    "io",
    "ops",
    "schedule",
    "stages",
]
