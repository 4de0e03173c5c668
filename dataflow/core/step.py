"""What a stage sees of the run: its replica, the current step and the current phase.

Plain data built by the planner and the runtime and read by every stage; kept in the
bottom layer so io (sharding reads a step's split) and stages need not import the
engine for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dataflow.core.protocols import Collective

__all__ = ["PhaseContext", "ReplicaContext", "StepContext", "StepSpec"]


@dataclass
class ReplicaContext:
    """Per-replica state on its worker: shared by all stages of one fit."""

    rank: int
    world_size: int
    device: torch.device
    seed: int
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    collective: Collective | None = None  # a process group when world_size > 1
    # A spatial layout (this worker holds a region of every sample): ``wrap_model(m)``
    # partitions the model, ``region_of(source)`` cuts a source to this worker's region.
    spatial: Any = None
    # a dataflow.sync.Local: each replica steps on its own gradients; AllReduce averages
    # the weights (and the optimizer state) at the end of each window instead
    local: Any = None
    # a dataflow.sync.Async: gradients go to a parameter store, weights come back from
    # it (``parameter_store``, the runtime's client; None with a single replica)
    asynchronous: Any = None
    parameter_store: Any = None
    window: tuple[int, int] | None = None  # the running window's [first, stop) steps
    # Local updates averaged at the parameter store (they survive a lost replica): the
    # runtime's ``retrain(parts)`` trains (step, owner) parts of the running window again
    # (a lost replica's, at the average); ``window_parts``: the window's planned parts;
    # Update's ``window_verdict()``: this replica's first non-finite step of the window
    retrain: Any = None
    window_parts: tuple[tuple[int, int], ...] = ()
    window_verdict: Any = None
    # The step options asked for (dataflow.core.precision: precision, channels_last,
    # compile, allow_cpu_fp16, capture, simulate_capture); Forward resolves them against
    # the device and model into ``step_options``
    requested_step_options: tuple[Any, ...] = ("fp32", False, False, False, False, False)
    step_options: Any = None
    # fp16: the loss scale (dataflow.core.precision.LossScale), alike on every replica
    loss_scale: Any = None
    # the allreduce bucket the fit planned (MiB; None: the default), for AllReduce
    # stages that leave bucket_mb to the engine (the user's stage objects stay as given)
    planned_bucket_mb: float | None = None
    # Update's clip_grad_norm (dataflow.stages.clipping), for AllReduce to clip each
    # gradient pushed to a parameter store (asynchronous updates) before it goes
    clip_grad_norm: float | None = None
    # Update's ema_decay: True when the optimizer's state keeps a moving average of the
    # weights (dataflow.stages.averaging), which evaluations then score too
    averages_weights: bool = False
    # Seconds this replica waited on its peers inside compute stages so far (the
    # reductions of sync_batchnorm's layers add to it): the runtime counts them as waits
    peer_wait_s: float = 0.0

    def parameters(self) -> list[Any]:
        """The model's parameters, listed once per model object: stages that need them
        every step (Update's checks, clipping) do not walk the module tree each time
        (``model.parameters()`` cost 0.24 ms a step on ResNet-50's 161 tensors)."""
        model = self.model
        listed = self.__dict__.get("_listed")
        if listed is None or listed[0] is not model:
            listed = self.__dict__["_listed"] = (model, list(model.parameters()))
        return listed[1]

    @property
    def local_updates(self) -> bool:
        return self.local is not None

    @property
    def settles_at_window_end(self) -> bool:
        """Whether replicas hold the same weights only at a window's end (local or
        asynchronous updates): evaluations wait for it."""
        return self.local is not None or self.asynchronous is not None

    state: dict[str, Any] = field(default_factory=dict)  # free space for custom stages


def micro_batch_sizes(size: int, count: int, *, paired: bool = False) -> list[int]:
    """``size`` samples in ``count`` near-equal parts, larger parts first: non-empty ones
    (fewer parts when ``size < count``), or, ``paired``, exactly ``count`` with empty
    parts where the samples run out (replicas whose BatchNorm reductions pair up)."""
    count = max(1, count if paired else min(count, size))
    base, extra = divmod(size, count)
    return [base + (1 if k < extra else 0) for k in range(count)]


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
    # The fit's LRDecay (dataflow.schedule.decay) at this step: a factor on the step's LR
    # (None: the fit has none)
    lr_decay: float | None = None

    def micro_batches_of(self, rank: int) -> int:
        return self.micro_batches[rank] if self.micro_batches else 1

    def micro_batch_size_of(self, rank: int) -> int:
        """The most samples replica ``rank`` holds in one forward/backward of this step."""
        return -(-self.local_batches[rank] // max(1, self.micro_batches_of(rank)))

    @functools.cached_property
    def paired_micro_batches(self) -> tuple[int, ...]:
        """Per k, the samples of every replica's k-th micro-batch of this step, run paired
        (``sync_batchnorm``: one reduction over them; every replica runs the same count
        of micro-batches, empty ones included, which the planner ensures and this
        checks). Once per step, in ``O(W + M)``: replica ``r``'s part ``k`` is ``b_r // M``
        plus one where ``k < b_r % M`` (``micro_batch_sizes``)."""
        counts = set(self.micro_batches) or {1}
        if len(counts) > 1:
            raise RuntimeError(
                f"sync_batchnorm: step {self.index} runs {list(self.micro_batches)} "
                "micro-batches per replica; paired reductions need the same count (a bug)"
            )
        (parts,) = counts
        longer = [0] * (parts + 1)  # replicas whose first k parts hold one sample more
        bases = 0
        for batch in self.local_batches:
            base, extra = divmod(batch, parts)
            bases += base
            longer[extra] += 1
        totals, more = [], sum(longer[1:])
        for k in range(parts):
            totals.append(bases + more)
            more -= longer[k + 1]
        return tuple(totals)


@dataclass
class StepContext:
    """What a stage sees during one step on one replica."""

    replica: ReplicaContext
    spec: StepSpec
    metrics: dict[str, Any] = field(default_factory=dict)
    micro_index: int = 0  # which micro-batch of gradient accumulation is running
    micro_count: int = 1
    micro_size: int | None = None  # samples in the running micro-batch (None: whole batch)
    # Whose part of the global batch this replica trains: its own (None), or, under
    # sample leases, a slower replica's that it took over (dataflow.runtime.leases)
    part: int | None = None

    @property
    def owner(self) -> int:
        """The replica whose share of the step's global batch this is."""
        return self.replica.rank if self.part is None else self.part

    @property
    def local_batch(self) -> int:
        return self.spec.local_batches[self.owner]

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
    # ... on the steps whose index is a multiple of this (the schedule's cadence)
    measure_every: int = 1
    # The rest of a phase after a lost worker (``steps`` start at the commit, split over
    # the survivors): stages keep their phase-level settings (LR ramp, statistics).
    continued: bool = False
    lr_factor: float = 1.0  # on_non_finite="rollback": the LR cut after each rollback

    def measures(self, index: int) -> bool:
        """Whether step ``index`` records gradient norms for the noise-scale estimate:
        every ``measure_every``-th step of the fit (by global index, so a phase continued
        after a lost worker, or resumed, measures the same steps)."""
        return self.measure_noise and index % max(1, self.measure_every) == 0
