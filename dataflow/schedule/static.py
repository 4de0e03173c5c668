"""The schedules decided before the fit: ``Fixed`` (one global batch) and ``Stepwise``
(the batch and LR at given epochs). ``Adaptive`` decides from measurements
(:mod:`dataflow.schedule.adaptive`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from dataflow.core.errors import BatchSizeError, ConfigError
from dataflow.core.phase import PhaseMeasurement, PhaseSpec
from dataflow.schedule.measured_lr import (
    ADASCALE_RULES,
    DEFAULT_MIN_MEASURED_STEPS,
    adascale_scale,
    check_measuring,
    measure_interval,
    noise_for_gain,
)
from dataflow.schedule.progress import (
    PROGRESS_TOLERANCE,
    phase_progress,
    progress_made,
    progress_so_far,
    statistical_gain,
)
from dataflow.schedule.rules import LR_RULES, _check_lr, _positive_int

STEPWISE_LR_RULES = (*sorted(LR_RULES), *ADASCALE_RULES)


@dataclass(frozen=True)
class Fixed:
    """One global batch size for the whole fit.

    ``epochs_per_phase`` cuts the fit into phases of that many epochs, so a
    speed-aware balancer (``balance.Throughput``) can re-split between them. ``lr``
    (default: the optimizer factory's) is the first param group's; each other group
    keeps its ratio to the first.
    """

    measures_noise: ClassVar[bool] = False

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
        _check_lr("Fixed", self.lr)
        if self.epochs_per_phase is not None:
            _positive_int("Fixed", "epochs_per_phase", self.epochs_per_phase)

    def next_phase(
        self,
        *,
        start_epoch: int,
        total_epochs: int,
        previous: PhaseSpec | None,
        measured: PhaseMeasurement | None = None,
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


@dataclass(frozen=True)
class Stepwise:
    """The user's table ``{epoch: global batch}``: a new phase at each listed epoch.

    The LR follows the batch by ``lr_scaling`` relative to the first batch ``B0``:
    "linear" (``lr × B/B0``, Goyal et al.), "sqrt" (``lr × sqrt(B/B0)``, for Adam-like
    optimizers), "none", or from the measured gradient noise scale ``B_noise``:
    "adascale" (AdaScale's gain ``(1 + B_noise/B0)/(1 + B_noise/B)``: linear while the
    noise dominates, flat once ``B`` is well above ``B_noise``, where linear scaling
    overshoots) or "adascale-sqrt" (its square root, for Adam-like optimizers). With
    those the engine measures the noise as it does for ``Adaptive`` (every k-th step,
    ``measure_every``; "auto": at least 60 measured steps a phase) and each phase's gain
    comes from the estimate at its start, once that rests on ``min_measured_steps``
    measured steps; until then the previous phase's LR scale is kept. An estimate of
    ``|G|²`` that is not positive means the noise dominates: the gain is then ``B/B0``.

    ``scale_invariant=True`` (with the AdaScale rules) counts training in progress, as
    AdaScale does, not in epochs of data: the table's epochs and the fit's ``epochs``
    are epochs at the first batch ``B0``, and a phase at batch ``B`` with gain ``r``
    makes ``r·B0/B`` of them per epoch of data (:mod:`dataflow.schedule.progress`).
    Each phase then runs as many whole data epochs as its progress needs, an LR decay
    follows the progress, and the fit ends once ``epochs`` of it are made: a larger
    batch trains for more epochs instead of stopping short of the small batch's result.

    ``lr`` is the base LR (default: the optimizer factory's), the first param group's:
    each other group keeps its ratio to the first. Each phase after the first ramps to
    its new LR over ``warmup_steps`` steps.
    """

    batches: dict[int, int]
    lr_scaling: str = "adascale"
    warmup_steps: int = 0
    lr: float | None = None
    min_measured_steps: int = DEFAULT_MIN_MEASURED_STEPS
    measure_every: int | str = "auto"
    scale_invariant: bool = False

    @property
    def counts_progress(self) -> bool:
        """Whether the fit's ``epochs`` count scale-invariant progress (the fit then ends
        when :meth:`next_phase` has no phase left, not at an epoch of data)."""
        return self.scale_invariant

    @property
    def measures_noise(self) -> bool:
        """Whether the engine must measure the gradient noise scale: for the AdaScale
        rules, when the table has a batch other than its first (else the LR never
        changes, and one replica would split its steps to measure for nothing)."""
        first = self.batches[0]
        return self.lr_scaling in ADASCALE_RULES and any(b != first for b in self.batches.values())

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
        if self.lr_scaling not in STEPWISE_LR_RULES:
            raise ConfigError(
                f"Stepwise(lr_scaling={self.lr_scaling!r}): use one of {list(STEPWISE_LR_RULES)}"
            )
        check_measuring("Stepwise", self.measure_every, self.min_measured_steps)
        if self.lr_scaling not in ADASCALE_RULES and (
            self.measure_every != "auto" or self.min_measured_steps != DEFAULT_MIN_MEASURED_STEPS
        ):
            raise ConfigError(
                f"Stepwise(lr_scaling={self.lr_scaling!r}, measure_every="
                f"{self.measure_every!r}, min_measured_steps={self.min_measured_steps}): "
                "measuring the gradient noise is only for lr_scaling='adascale' or "
                "'adascale-sqrt'; leave measure_every and min_measured_steps out"
            )
        if not isinstance(self.scale_invariant, bool):
            raise ConfigError(
                f"Stepwise(scale_invariant={self.scale_invariant!r}): must be True or False"
            )
        if self.scale_invariant and self.lr_scaling not in ADASCALE_RULES:
            raise ConfigError(
                f"Stepwise(lr_scaling={self.lr_scaling!r}, scale_invariant=True): progress "
                "is counted from the gain measured for lr_scaling='adascale' or "
                "'adascale-sqrt'; use one of those, or leave scale_invariant out"
            )
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ConfigError(f"Stepwise(warmup_steps={self.warmup_steps!r}): must be an int >= 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"Stepwise(warmup_steps={self.warmup_steps}): must be >= 0")
        _check_lr("Stepwise", self.lr)

    def next_phase(
        self,
        *,
        start_epoch: int,
        total_epochs: int,
        previous: PhaseSpec | None,
        measured: PhaseMeasurement | None = None,
    ) -> PhaseSpec | None:
        """The phase from ``start_epoch`` on. Counting progress (``scale_invariant``),
        the table and ``total_epochs`` are in progress, and None says the fit is done."""
        done = progress_so_far(previous) if self.scale_invariant else float(start_epoch)
        if self.scale_invariant and progress_made(done, total_epochs):
            return None
        starts = sorted(self.batches)
        current = max(e for e in starts if e <= done + PROGRESS_TOLERANCE)
        later = [e for e in starts if done + PROGRESS_TOLERANCE < e < total_epochs]
        target = later[0] if later else total_epochs
        base, batch = self.batches[0], self.batches[current]
        noise = None
        if self.lr_scaling not in ADASCALE_RULES:
            scale = LR_RULES[self.lr_scaling](batch / base)
        elif previous is None or not self.measures_noise:
            scale = 1.0  # the base LR belongs to the first batch (the only one)
        else:
            noise = noise_for_gain(measured, previous, self.min_measured_steps)
            scale = adascale_scale(self.lr_scaling, noise, base, batch, previous.lr_scale)
        epochs, progress = target - start_epoch, {}
        if self.scale_invariant:
            first = previous is None or not self.measures_noise
            gain = 1.0 if first else statistical_gain(noise, base, batch, previous)
            epochs, progress = phase_progress(done, target, gain, base, batch)
        noise = None if noise == math.inf else noise  # (the history keeps plain JSON)
        return PhaseSpec(
            index=0 if previous is None else previous.index + 1,
            start_epoch=start_epoch,
            end_epoch=start_epoch + epochs,
            global_batch=batch,
            lr=None if self.lr is None else self.lr * scale,
            lr_scale=scale,
            warmup_steps=0 if previous is None else self.warmup_steps,
            noise_scale=noise,
            gain=scale if self.lr_scaling in ADASCALE_RULES else None,
            **progress,
        )

    def measure_interval(self, phase_steps: int) -> int:
        """Measure the noise on every k-th step of a phase of ``phase_steps`` steps (with
        the AdaScale rules; see :func:`dataflow.schedule.measured_lr.measure_interval`)."""
        return measure_interval(self.measure_every, phase_steps)

    def max_batch(self) -> int:
        return max(self.batches.values())
