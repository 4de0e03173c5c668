"""What the fit trains next, pure: the schedule's next phase and the segment of steps
the machine runs of it (the balancer's split, each replica's micro-batches), and the
rest of a phase re-split after a recovery or a resume.

No Dask, no torch: the state machine asks through ``ChoosePhase`` and
``PlanSegment`` and gets the answers as events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dataflow.core.phase import PhaseMeasurement, PhaseSpec
from dataflow.core.step import StepSpec
from dataflow.io.sampler import steps_per_epoch
from dataflow.planning.plan import phase_steps, resplit_steps
from dataflow.schedule.balance import micro_batch_counts


@dataclass(frozen=True, kw_only=True)
class Planner:
    """What a fit's plans depend on: the schedule, the balancer, the dataset's size, the
    memory cap (one int, or one per replica), and the LR's decay over the fit's
    ``epochs`` (:mod:`dataflow.schedule.decay`)."""

    schedule: Any
    balancer: Any
    num_samples: int
    drop_last: bool = False
    max_micro_batch: int | tuple[int, ...] | None = None
    measures_noise: bool = False
    lr_decay: Any = None
    epochs: int | None = None
    # sync_batchnorm: every replica runs a step in as many micro-batches as the most
    # split one (its k-th micro-batch then reduces with the others' k-th)
    paired_micro_batches: bool = False

    def next_phase(
        self,
        start_epoch: int,
        total_epochs: int,
        previous: PhaseSpec | None,
        measured: PhaseMeasurement | None = None,
    ) -> PhaseSpec | None:
        """The schedule's next phase (None: the fit is done, for a schedule that counts
        progress); only schedules that measure the gradient noise (``measures_noise``)
        are given the measurement."""
        extra: dict[str, Any] = {"measured": measured} if self.measures_noise else {}
        if getattr(self.schedule, "needs_epoch_size", False):  # phases of N steps
            extra.update(num_samples=self.num_samples, drop_last=self.drop_last)
        return self.schedule.next_phase(
            start_epoch=start_epoch, total_epochs=total_epochs, previous=previous, **extra
        )

    def measure_every(self, phase_steps: int) -> int:
        """The noise is measured on every k-th step of a phase of ``phase_steps`` steps:
        the schedule's ``measure_interval`` (``Adaptive.measure_every``), else every step."""
        interval = getattr(self.schedule, "measure_interval", None)
        return interval(phase_steps) if self.measures_noise and interval is not None else 1

    def phase_steps(
        self,
        phase: PhaseSpec,
        replicas: int,
        first_index: int,
        measured: Sequence[Sequence[float]] = (),
        memory_cap: int | None = None,
    ) -> tuple[StepSpec, ...]:
        """The phase's steps, split by the balancer from the speeds ``measured`` so far
        (per past phase, each replica's samples/s); ``memory_cap``: the micro-batch cap
        the fit learned from out-of-memory errors."""
        epochs = phase.end_epoch - phase.start_epoch
        count = epochs * steps_per_epoch(
            self.num_samples, phase.global_batch, drop_last=self.drop_last
        )
        return phase_steps(
            num_samples=self.num_samples,
            phase=phase,
            split=lambda size: self.balancer.split(size, replicas, measured),
            drop_last=self.drop_last,
            first_index=first_index,
            micro_batches=self.micro_batches(
                replicas, memory_cap=memory_cap, measure_every=self.measure_every(count)
            ),
            lr_decay=self.decay_at(phase),
        )

    @property
    def counts_progress(self) -> bool:
        """Whether the fit's epochs count the schedule's progress, not epochs of data."""
        return bool(getattr(self.schedule, "counts_progress", False))

    def decay_at(self, phase: PhaseSpec | None = None) -> Callable[[float], float] | None:
        """The factor on a step's LR at its position in epochs of data (None: no decay);
        in ``phase``'s scale-invariant progress where it counts that."""
        decay = self.lr_decay
        if decay is None:
            return None
        if self.epochs is None:
            raise RuntimeError("Planner(lr_decay=...) needs the fit's epochs (a bug)")
        if phase is not None and phase.progress_start is not None:
            return lambda epoch: decay.factor(phase.progress_at(epoch), self.epochs)
        return lambda epoch: decay.factor(epoch, self.epochs)

    def rest(
        self,
        segment: tuple[StepSpec, ...],
        commit: int,
        replicas: int,
        memory_cap: int | None = None,
        phase_steps: int | None = None,
    ) -> tuple:
        """The steps of ``segment`` from ``commit`` on, split anew over ``replicas`` (after
        a recovery); every sample of the epoch in progress is still read once.
        ``phase_steps``: the whole phase's step count (its noise measuring cadence)."""
        every = self.measure_every(phase_steps or len(segment))
        return resplit_steps(
            segment,
            commit,
            split=lambda size: self.balancer.split(size, replicas, []),
            micro_batches=self.micro_batches(
                replicas, after_loss=True, memory_cap=memory_cap, measure_every=every
            ),
        )

    def resumed(self, segment: tuple[StepSpec, ...], commit: int, replicas: int) -> tuple:
        """A phase's steps left after a mid-phase checkpoint. On as many replicas as it
        was written on, each keeps its split, so every replica reads what it would have
        read uninterrupted (bit-identical); on another count, split anew."""
        if len(segment[0].local_batches) == replicas:
            return resplit_steps(segment, commit, split=None)
        return self.rest(segment, commit, replicas)

    def micro_batches(
        self,
        replicas: int,
        after_loss: bool = False,
        memory_cap: int | None = None,
        measure_every: int = 1,
    ) -> Callable[[tuple[int, ...], int], tuple[int, ...]]:
        """Each replica's micro-batches for a split of step ``index``: above the memory
        cap, accumulate; one replica estimates the gradient noise from two micro-batches
        of each measured step (every ``measure_every``-th; the others run whole, since
        half batches cost a GPU nearly twice the step). The cap is the user's
        ``max_micro_batch`` and, below it, ``memory_cap`` (learned)."""
        splits_to_measure = replicas == 1 and self.measures_noise

        def count(local: tuple[int, ...], index: int) -> tuple[int, ...]:
            caps = self.max_micro_batch
            if after_loss and isinstance(caps, tuple) and len(caps) != len(local):
                caps = min(caps)  # after a lost worker: the tightest cap for every replica
            measured = splits_to_measure and index % max(1, measure_every) == 0
            minimum = 2 if measured else 1
            counts = micro_batch_counts(local, tighter(caps, memory_cap), minimum=minimum)
            if self.paired_micro_batches and len(counts) > 1:
                return (max(counts),) * len(counts)
            return counts

        return count


def tighter(caps: int | tuple[int, ...] | None, cap: int | None) -> int | tuple[int, ...] | None:
    """The user's cap (one, or one per replica) lowered to ``cap`` where it is larger; the
    user's stays an upper bound."""
    if cap is None:
        return caps
    if isinstance(caps, tuple):
        return tuple(min(c, cap) for c in caps)
    return cap if caps is None else min(caps, cap)
