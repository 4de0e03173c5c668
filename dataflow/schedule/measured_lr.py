"""The LR from the measured gradient noise scale: what ``Adaptive`` and
``Stepwise(lr_scaling="adascale")`` share.

A schedule that measures the noise asks the engine to measure it on every k-th step
(:func:`measure_interval`), trusts an estimate only once it rests on enough measured
steps (:func:`trusted_noise_scale`), and turns it into an LR scale by AdaScale's gain
(:func:`adascale_scale`, Johnson et al. 2020): linear in ``B/B0`` while the noise
dominates the gradient, flat once the batch is well above the noise scale, where a
larger LR no longer buys progress and linear scaling overshoots.
"""

from __future__ import annotations

import math

from dataflow.core.errors import ConfigError
from dataflow.core.phase import PhaseMeasurement, PhaseSpec
from dataflow.schedule.noise_scale import adascale_gain

ADASCALE_RULES = ("adascale", "adascale-sqrt")

# measure_every="auto": the measured steps a phase keeps at least. The driver's tracker
# (NoiseScaleTracker, smoothing a = 0.05) is an EMA; after n measured steps its variance is
# a/(2 - a) (1 + (1 - a)^n)/(1 - (1 - a)^n) times one step's, within 10 % of its floor
# a/(2 - a) ~ 1/39 from n = 60 on (0.95^60 = 0.046). More pairs per phase only shorten the
# stretch of training the estimate covers; fewer raise its variance (x1.8 at 24, x3.3 at 12).
AUTO_MEASURED_PER_PHASE = 60
DEFAULT_MIN_MEASURED_STEPS = 20  # about the tracker's smoothing horizon


def measure_interval(measure_every: int | str, phase_steps: int) -> int:
    """Measure the noise on every k-th step of a phase of ``phase_steps`` steps: the int
    ``measure_every``, or with ``"auto"`` ``max(1, phase_steps // 60)``."""
    if measure_every != "auto":
        return int(measure_every)
    return max(1, phase_steps // AUTO_MEASURED_PER_PHASE)


def check_measuring(owner: str, measure_every: object, min_measured_steps: object) -> None:
    """``measure_every`` is "auto" or an int >= 1, ``min_measured_steps`` an int >= 0;
    else a ConfigError naming ``owner(field=...)`` and what the field means."""
    every = measure_every
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(
            f"{owner}(measure_every={every!r}): must be 'auto' or an int >= 1, measure "
            "the gradient noise on every k-th step ('auto': k from the phase's steps)"
        )
    steps = min_measured_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(
            f"{owner}(min_measured_steps={steps!r}): must be an int >= 0, the measured "
            "steps an estimate must rest on before the schedule follows it (0: any)"
        )


def measured_steps(measured: PhaseMeasurement, previous: PhaseSpec) -> int | None:
    """The steps ``measured``'s estimate rests on: ``measured.measured_steps`` when the
    driver reports it; else, after the first phase, that phase's ``steps`` (the tracker
    has seen exactly those); else None (unknown: the estimate is trusted)."""
    if measured.measured_steps is not None:
        return measured.measured_steps
    return measured.steps if previous.index == 0 else None


def rests_on_enough(
    measured: PhaseMeasurement, previous: PhaseSpec, min_measured_steps: int
) -> bool:
    """Whether ``measured`` rests on at least ``min_measured_steps`` measured steps (an
    estimate from a few steps can be off by orders of magnitude); unknown counts: yes."""
    steps = measured_steps(measured, previous)
    return steps is None or steps >= min_measured_steps


def trusted_noise_scale(
    measured: PhaseMeasurement | None, previous: PhaseSpec, min_measured_steps: int
) -> float | None:
    """The estimate the next phase is chosen from: None without one, or while it rests on
    fewer than ``min_measured_steps`` measured steps."""
    if measured is None or not rests_on_enough(measured, previous, min_measured_steps):
        return None
    return measured.noise_scale


def noise_for_gain(
    measured: PhaseMeasurement | None, previous: PhaseSpec, min_measured_steps: int
) -> float | None:
    """The noise scale an LR gain is computed at: the trusted estimate; ``math.inf`` when
    the trusted estimate of ``|G|²`` is not positive while that of ``tr(Σ)`` is (the
    noise dominates so much that ``|G|²`` is not resolved: AdaScale's gain is then the
    linear rule's ``B/B0``); None without a trusted estimate."""
    if measured is None or not rests_on_enough(measured, previous, min_measured_steps):
        return None
    if measured.noise_scale is not None:
        return measured.noise_scale
    gradient_sq, trace_cov = measured.gradient_sq, measured.trace_cov
    if gradient_sq is not None and gradient_sq <= 0 and trace_cov is not None and trace_cov > 0:
        return math.inf
    return None


def adascale_scale(
    rule: str, noise_scale: float | None, base_batch: int, batch: int, previous: float
) -> float:
    """The LR scale at ``batch`` relative to the base LR at ``base_batch``: AdaScale's
    gain ``(1 + B_noise/B0)/(1 + B_noise/B)``, between 1 and ``B/B0`` (``"adascale"``),
    or its square root (``"adascale-sqrt"``, for Adam-like optimizers); ``previous``
    (the last phase's scale) without an estimate."""
    if noise_scale is None:
        return previous
    gain = adascale_gain(noise_scale, base_batch, batch)
    return gain**0.5 if rule == "adascale-sqrt" else gain
