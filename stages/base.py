"""The stage contract and the values that flow between stages.

A stage is a small object with a typed config, built on the driver, pickled once
to every replica's worker, and driven there by the replica runtime:
``setup`` once per fit, ``begin_phase``/``end_phase`` around each phase,
``begin_step`` then ``run`` once per training step (in graph order).
Runtime state (the model, hooks, threads) lives on the :class:`ReplicaContext`
or in private attributes set in ``setup``; it never travels back to the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    """One replica's share of a global batch: inputs, optional targets, sample count."""

    x: Any
    y: Any = None
    size: int = 0
    indices: Any = None  # sample indices in the source, for the sample ledger


@dataclass
class ForwardOutput:
    """What Forward hands to Backward: the local mean loss and the model output."""

    loss: torch.Tensor | None
    output: Any
    batch: Batch


@dataclass
class Gradients:
    """Marker flowing from Backward onwards: gradients live on ``model.parameters()``.

    ``reduced`` is True once they are the mean gradient of the *global* batch.
    """

    samples: int
    reduced: bool = False


@dataclass
class ReplicaContext:
    """Per-replica state on its worker: shared by all stages of one fit."""

    rank: int
    world_size: int
    device: torch.device
    seed: int
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    collective: Any = None  # dataflow.runtime.collective.Collective when world_size > 1
    state: dict[str, Any] = field(default_factory=dict)  # free space for custom stages


@dataclass(frozen=True)
class StepSpec:
    """One global training step, identical on every replica (pure data).

    ``start`` counts the samples of the epoch before this step; replica ``r`` takes
    the next ``local_batches[r]`` samples of its epoch stream (``io.replica_streams``).
    """

    index: int
    epoch: int
    step_in_epoch: int
    start: int
    global_batch: int
    local_batches: tuple[int, ...]
    last_in_epoch: bool


@dataclass
class StepContext:
    """What a stage sees during one step on one replica."""

    replica: ReplicaContext
    spec: StepSpec
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def local_batch(self) -> int:
        return self.spec.local_batches[self.replica.rank]

    @property
    def global_batch(self) -> int:
        return self.spec.global_batch

    @property
    def weight(self) -> float:
        """This replica's share of the global mean: ``b_r / B``."""
        return self.local_batch / self.spec.global_batch


@dataclass(frozen=True)
class PhaseContext:
    """What a stage sees at a phase boundary: the phase's steps and learning rate
    (``lr``, else the optimizer's initial LR × ``lr_scale``, ramped over ``warmup_steps``)."""

    index: int
    steps: tuple[StepSpec, ...]
    lr: float | None
    lr_scale: float = 1.0
    warmup_steps: int = 0


class Stage:
    """Base class of every stage. Subclasses override what they need.

    ``name`` is unique within a graph (the graph suffixes duplicates). A user stage
    subclasses this and implements :meth:`run`; see ``examples/custom_graph.py``.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__

    def setup(self, replica: ReplicaContext) -> None:
        """Once per fit on the worker, in graph order (Forward builds the model first)."""

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None:
        """Before the first step of each phase."""

    def begin_step(self, step: StepContext) -> None:
        """Before any stage runs in this step (e.g. arm gradient hooks)."""

    def run(self, step: StepContext, *inputs: Any) -> Any:
        """Do this stage's work for one step; the return value feeds downstream stages."""
        return inputs[0] if inputs else None

    def end_phase(self, replica: ReplicaContext) -> dict[str, Any]:
        """After the last step of a phase; returns statistics for the driver."""
        return {}

    def teardown(self, replica: ReplicaContext) -> None:
        """When the fit ends or fails: release threads, hooks, buffers."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
