"""A phase of training (epochs at one global batch and LR), what was measured in it, and
the LR ramp within it.

Schedules produce phases, the planner cuts them into steps, Update ramps the LR: the
types live in the bottom layer so stages need not import the engine's schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dataflow.core.errors import BatchSizeError, ConfigError

__all__ = ["PhaseMeasurement", "PhaseSpec", "lr_at"]


@dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    """One phase: epochs ``[start_epoch, end_epoch)`` at global batch ``global_batch``.

    The learning rate is ``lr`` if given, else the optimizer factory's LR times
    ``lr_scale``. With ``warmup_steps``, it ramps linearly from the previous phase's
    LR to the new one over the first steps of the phase (:func:`lr_at`), so a jump
    in LR does not destabilise training. ``noise_scale`` and ``gain`` are for the
    history: the noise-scale estimate an adaptive schedule chose the phase from, and
    the LR gain it applied (None for schedules that do not measure).

    ``progress_start`` and ``progress_end`` (a schedule that counts scale-invariant
    progress, ``scale_invariant=True``): the progress made before the phase
    and after it, in epochs at the first batch; progress grows linearly over the
    phase's epochs (:meth:`progress_at`). None for the other schedules.
    """

    index: int
    start_epoch: int
    end_epoch: int
    global_batch: int
    lr: float | None = None
    lr_scale: float = 1.0
    warmup_steps: int = 0
    noise_scale: float | None = None
    gain: float | None = None
    progress_start: float | None = None
    progress_end: float | None = None

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
        if self.noise_scale is not None and not self.noise_scale >= 0:
            raise ConfigError(
                f"PhaseSpec: noise_scale must be >= 0 or None, got {self.noise_scale}"
            )
        if self.gain is not None and not self.gain > 0:
            raise ConfigError(f"PhaseSpec: gain must be > 0 or None, got {self.gain}")
        start, end = self.progress_start, self.progress_end
        if (start is None) != (end is None) or (
            start is not None and not (math.isfinite(end) and 0 <= start < end)
        ):
            raise ConfigError(
                f"PhaseSpec: progress_start ({start}) and progress_end ({end}) must both be "
                "None or finite with 0 <= progress_start < progress_end"
            )

    def progress_at(self, epoch: float) -> float | None:
        """The scale-invariant progress at ``epoch`` (a fractional epoch of the data inside
        the phase), or None for a phase that does not count it."""
        if self.progress_start is None or self.progress_end is None:
            return None
        per_epoch = (self.progress_end - self.progress_start) / (self.end_epoch - self.start_epoch)
        return self.progress_start + (epoch - self.start_epoch) * per_epoch


@dataclass(frozen=True)
class PhaseMeasurement:
    """What the driver measured in the phase that just ended, for adaptive schedules.

    ``noise_scale``, ``gradient_sq`` and ``trace_cov`` come from
    :class:`dataflow.schedule.noise_scale.NoiseScaleTracker` (None when not measured);
    ``samples_per_second`` is the phase's global throughput, ``steps`` its step count.
    ``measured_steps`` is how many steps the estimate rests on: the tracker's ``steps``,
    every step whose gradient norms it took since the fit began (None: not reported;
    :meth:`Adaptive.measured_steps` says what is assumed then).
    """

    noise_scale: float | None = None
    gradient_sq: float | None = None
    trace_cov: float | None = None
    samples_per_second: float = 0.0
    steps: int = 0
    measured_steps: int | None = None

    def __post_init__(self) -> None:
        if self.noise_scale is not None and not self.noise_scale >= 0:
            raise ConfigError(
                f"PhaseMeasurement: noise_scale must be >= 0 or None, got {self.noise_scale}; "
                "pass NoiseScaleTracker.noise_scale, which is None when not resolved"
            )
        for name in ("gradient_sq", "trace_cov"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"PhaseMeasurement: {name} must be finite or None, got {value}")
        if not self.samples_per_second >= 0:
            raise ConfigError(
                f"PhaseMeasurement: samples_per_second must be >= 0, got {self.samples_per_second}"
            )
        for name in ("steps", "measured_steps"):
            value = getattr(self, name)
            if value is None and name == "measured_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"PhaseMeasurement: {name} must be an int >= 0, got {value!r}")


def lr_at(start: float, target: float, step_in_phase: int, warmup_steps: int) -> float:
    """The LR at step ``step_in_phase`` (0-based) of a phase ramping from ``start`` to
    ``target`` over ``warmup_steps`` steps; ``target`` from step ``warmup_steps - 1`` on."""
    if warmup_steps <= 0 or step_in_phase >= warmup_steps - 1:
        return target
    return start + (target - start) * (step_in_phase + 1) / warmup_steps
