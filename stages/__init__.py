"""The stage kinds a training step is made of. Subclass :class:`Stage` for your own."""

from dataflow.stages.allreduce import AllReduce
from dataflow.stages.backward import Backward
from dataflow.stages.base import (
    Batch,
    ForwardOutput,
    Gradients,
    PhaseContext,
    ReplicaContext,
    Stage,
    StepContext,
    StepSpec,
)
from dataflow.stages.evaluate import Evaluate, accuracy
from dataflow.stages.forward import Forward
from dataflow.stages.load import Load
from dataflow.stages.transform import Transform
from dataflow.stages.update import Update

__all__ = [
    "AllReduce",
    "Backward",
    "Batch",
    "Evaluate",
    "Forward",
    "ForwardOutput",
    "Gradients",
    "Load",
    "PhaseContext",
    "ReplicaContext",
    "Stage",
    "StepContext",
    "StepSpec",
    "Transform",
    "Update",
    "accuracy",
]
