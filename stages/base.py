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

    def slice(self, start: int, stop: int) -> Batch:
        """Samples ``[start, stop)``: one micro-batch of gradient accumulation (views)."""
        return Batch(
            x=_slice(self.x, start, stop),
            y=_slice(self.y, start, stop),
            size=stop - start,
            indices=None if self.indices is None else self.indices[start:stop],
        )


def _slice(value: Any, start: int, stop: int) -> Any:
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_slice(v, start, stop) for v in value)
    return value[start:stop]


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
    micro_batches: tuple[int, ...] = ()  # per replica, micro-batches per step (() = all 1)
    # The epoch was re-split mid-way (a lost worker): for each earlier split, the samples
    # each replica was given and had consumed; the rest of the epoch is cut anew
    # (``io.sharding.continued_streams``). Empty for an epoch run under one split.
    earlier_splits: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    def micro_batches_of(self, rank: int) -> int:
        return self.micro_batches[rank] if self.micro_batches else 1


@dataclass
class StepContext:
    """What a stage sees during one step on one replica."""

    replica: ReplicaContext
    spec: StepSpec
    metrics: dict[str, Any] = field(default_factory=dict)
    micro_index: int = 0  # which micro-batch of gradient accumulation is running
    micro_count: int = 1
    micro_size: int | None = None  # samples in the running micro-batch (None: whole batch)

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

    @property
    def micro_weight(self) -> float:
        """The running micro-batch's share of the local mean: ``m_k / b_r`` (1 without
        accumulation). Forward scales the loss by it, so the accumulated gradient is the
        mean gradient of the replica's whole local batch."""
        if self.micro_count == 1 or self.micro_size is None:
            return 1.0
        return self.micro_size / self.local_batch

    @property
    def last_micro_batch(self) -> bool:
        return self.micro_index == self.micro_count - 1


@dataclass(frozen=True)
class PhaseContext:
    """What a stage sees at a phase boundary: the phase's steps and learning rate
    (``lr``, else the optimizer's initial LR × ``lr_scale``, ramped over ``warmup_steps``)."""

    index: int
    steps: tuple[StepSpec, ...]
    lr: float | None
    lr_scale: float = 1.0
    warmup_steps: int = 0
    measure_noise: bool = False  # record gradient norms for the noise-scale estimate
    # The rest of a phase after a lost worker (``steps`` start at the commit, split over
    # the survivors): stages keep their phase-level settings (LR ramp, statistics).
    continued: bool = False
    lr_factor: float = 1.0  # on_non_finite="rollback": the LR cut after each rollback


class Stage:
    """Base class of every stage. Subclasses override what they need.

    ``name`` is unique within a graph (the graph suffixes duplicates). A user stage
    subclasses this and implements :meth:`run`; see ``examples/custom_graph.py``.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__

    def setup(self, replica: ReplicaContext) -> None:
        """Once per fit on the worker, in graph order (Forward builds the model first)."""

    def regroup(self, replica: ReplicaContext) -> None:
        """Between phases, after the set of replicas changed (workers joined): the
        context has the new ``world_size`` and ``collective``. Stages that hold state
        tied to the process group rebuild it here."""

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None:
        """Before the first step of each phase."""

    def phase_state(self) -> dict[str, Any] | None:
        """Phase-level settings a replica joining mid-phase must share (after a lost
        worker: the LR ramp's start and target); plain values. None: nothing."""
        return None

    def load_phase_state(self, state: dict[str, Any]) -> None:
        """Take over :meth:`phase_state` of rank 0 (a replica joining mid-phase)."""

    def begin_step(self, step: StepContext) -> None:
        """Before any stage runs in this step (e.g. arm gradient hooks)."""

    #: Runs once per micro-batch when a replica accumulates gradients (Forward, Backward):
    #: the runtime slices the batch and runs each contiguous run of such stages per slice.
    per_micro_batch: bool = False

    def begin_micro_batch(self, step: StepContext) -> None:
        """Before each micro-batch of a step that accumulates gradients (e.g. only the
        last micro-batch's backward may start the allreduce)."""

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
