"""Batch-size schedules: what global batch and learning rate each phase uses.

A phase is a run of epochs with one global batch size ``B``, one learning rate
and one set of replicas. The engine asks the schedule for the next phase at each
phase boundary, so adaptive schedules can decide from what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dataflow.errors import BatchSizeError, ConfigError


@dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    """One phase: epochs ``[start_epoch, end_epoch)`` at global batch ``global_batch``.

    The learning rate is ``lr`` if given, else the optimizer factory's LR times
    ``lr_scale``. With ``warmup_steps``, it ramps linearly from the previous phase's
    LR to the new one over the first steps of the phase (:func:`lr_at`), so a jump
    in LR does not destabilise training.
    """

    index: int
    start_epoch: int
    end_epoch: int
    global_batch: int
    lr: float | None = None
    lr_scale: float = 1.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.end_epoch <= self.start_epoch:
            raise ConfigError(
                f"PhaseSpec: end_epoch ({self.end_epoch}) must be after "
                f"start_epoch ({self.start_epoch})"
            )
        if self.global_batch <= 0:
            raise BatchSizeError(f"PhaseSpec: global_batch must be > 0, got {self.global_batch}")
        if not self.lr_scale > 0:
            raise ConfigError(f"PhaseSpec: lr_scale must be > 0, got {self.lr_scale}")
        if self.warmup_steps < 0:
            raise ConfigError(f"PhaseSpec: warmup_steps must be >= 0, got {self.warmup_steps}")


def lr_at(start: float, target: float, step_in_phase: int, warmup_steps: int) -> float:
    """The LR at step ``step_in_phase`` (0-based) of a phase ramping from ``start`` to
    ``target`` over ``warmup_steps`` steps; ``target`` from step ``warmup_steps - 1`` on."""
    if warmup_steps <= 0 or step_in_phase >= warmup_steps - 1:
        return target
    return start + (target - start) * (step_in_phase + 1) / warmup_steps


LR_RULES = {
    "linear": lambda ratio: ratio,
    "sqrt": lambda ratio: ratio**0.5,
    "none": lambda ratio: 1.0,
}


@runtime_checkable
class Schedule(Protocol):
    """Chooses each phase; ``previous`` is None for the first one."""

    def next_phase(
        self, *, start_epoch: int, total_epochs: int, previous: PhaseSpec | None
    ) -> PhaseSpec: ...

    def max_batch(self) -> int:
        """The largest global batch this schedule can ask for (validated up front)."""
        ...


@dataclass(frozen=True)
class Fixed:
    """One global batch size for the whole fit.

    ``epochs_per_phase`` cuts the fit into phases of that many epochs, so a
    speed-aware balancer (``balance.Throughput``) can re-split between them.
    """

    batch_size: int
    lr: float | None = None
    epochs_per_phase: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise BatchSizeError(
                f"Fixed(batch_size=...) must be an int, got {type(self.batch_size).__name__}"
            )
        if self.batch_size <= 0:
            raise BatchSizeError(
                f"Fixed(batch_size={self.batch_size}): batch_size must be a positive number "
                "of samples per global step, e.g. Fixed(batch_size=64)"
            )
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"Fixed(lr={self.lr}): lr must be > 0 or None")
        if self.epochs_per_phase is not None:
            _positive_int("Fixed", "epochs_per_phase", self.epochs_per_phase)

    def next_phase(
        self, *, start_epoch: int, total_epochs: int, previous: PhaseSpec | None
    ) -> PhaseSpec:
        return PhaseSpec(
            index=0 if previous is None else previous.index + 1,
            start_epoch=start_epoch,
            end_epoch=min(total_epochs, start_epoch + (self.epochs_per_phase or total_epochs)),
            global_batch=self.batch_size,
            lr=self.lr,
        )

    def max_batch(self) -> int:
        return self.batch_size


def _positive_int(owner: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BatchSizeError(f"{owner}: {field} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Stepwise:
    """The user's table ``{epoch: global batch}``: a new phase at each listed epoch.

    The LR follows the batch by ``lr_scaling`` relative to the first batch:
    "linear" (``lr × B/B0``, Goyal et al.), "sqrt" (``lr × sqrt(B/B0)``, for Adam-like
    optimizers) or "none"; ``lr`` is the base LR (default: the optimizer factory's).
    Each phase after the first ramps to its new LR over ``warmup_steps`` steps.
    """

    batches: dict[int, int]
    lr_scaling: str = "linear"
    warmup_steps: int = 0
    lr: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.batches, dict) or not self.batches:
            raise ConfigError(
                f"Stepwise(batches={self.batches!r}): give a dict {{epoch: global batch}}, "
                "e.g. Stepwise({0: 64, 10: 256})"
            )
        for epoch, batch in self.batches.items():
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ConfigError(
                    f"Stepwise(batches=...): key {epoch!r} is not an epoch; keys are ints >= 0"
                )
            _positive_int("Stepwise(batches=...)", f"the batch at epoch {epoch}", batch)
        if 0 not in self.batches:
            raise ConfigError(
                f"Stepwise(batches={self.batches}): needs the batch for epoch 0, e.g. "
                f"{{0: {min(self.batches.values())}, ...}}"
            )
        if self.lr_scaling not in LR_RULES:
            raise ConfigError(
                f"Stepwise(lr_scaling={self.lr_scaling!r}): use one of {sorted(LR_RULES)}"
            )
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ConfigError(f"Stepwise(warmup_steps={self.warmup_steps!r}): must be an int >= 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"Stepwise(warmup_steps={self.warmup_steps}): must be >= 0")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"Stepwise(lr={self.lr}): lr must be > 0 or None")

    def next_phase(
        self, *, start_epoch: int, total_epochs: int, previous: PhaseSpec | None
    ) -> PhaseSpec:
        starts = sorted(self.batches)
        current = max(e for e in starts if e <= start_epoch)
        later = [e for e in starts if e > start_epoch and e < total_epochs]
        batch = self.batches[current]
        scale = LR_RULES[self.lr_scaling](batch / self.batches[0])
        return PhaseSpec(
            index=0 if previous is None else previous.index + 1,
            start_epoch=start_epoch,
            end_epoch=later[0] if later else total_epochs,
            global_batch=batch,
            lr=None if self.lr is None else self.lr * scale,
            lr_scale=scale,
            warmup_steps=0 if previous is None else self.warmup_steps,
        )

    def max_batch(self) -> int:
        return max(self.batches.values())
