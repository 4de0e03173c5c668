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

    ``lr=None`` keeps the learning rate the optimizer factory set.
    """

    index: int
    start_epoch: int
    end_epoch: int
    global_batch: int
    lr: float | None = None

    def __post_init__(self) -> None:
        if self.end_epoch <= self.start_epoch:
            raise ConfigError(
                f"PhaseSpec: end_epoch ({self.end_epoch}) must be after "
                f"start_epoch ({self.start_epoch})"
            )
        if self.global_batch <= 0:
            raise BatchSizeError(f"PhaseSpec: global_batch must be > 0, got {self.global_batch}")


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
    """One global batch size for the whole fit."""

    batch_size: int
    lr: float | None = None

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

    def next_phase(
        self, *, start_epoch: int, total_epochs: int, previous: PhaseSpec | None
    ) -> PhaseSpec:
        return PhaseSpec(
            index=0 if previous is None else previous.index + 1,
            start_epoch=start_epoch,
            end_epoch=total_epochs,
            global_batch=self.batch_size,
            lr=self.lr,
        )

    def max_batch(self) -> int:
        return self.batch_size
