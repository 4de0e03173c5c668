"""``Adaptive``: the auto-tuned batch schedule (grows, and shrinks, the global batch with
the measured gradient noise scale). Re-exported by :mod:`dataflow.schedule`, its
public home."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from dataflow.core.errors import BatchSizeError, ConfigError
from dataflow.core.phase import PhaseMeasurement, PhaseSpec
from dataflow.costmodel.best_settings import statistical_efficiency
from dataflow.io.sampler import steps_per_epoch
from dataflow.schedule.measured_lr import (
    ADASCALE_RULES,
    DEFAULT_MIN_MEASURED_STEPS,
    adascale_scale,
    check_measuring,
    measure_interval,
    measured_steps,
    trusted_noise_scale,
)
from dataflow.schedule.progress import (
    phase_progress,
    progress_made,
    progress_so_far,
    statistical_gain,
)
from dataflow.schedule.rules import LR_RULES, _finite_number, _positive_int, _round_down

ADAPTIVE_LR_RULES = (*ADASCALE_RULES, *sorted(LR_RULES))


@dataclass(frozen=True, init=False, repr=False)
class Adaptive:
    """The auto-tuner: grows the global batch toward the measured gradient noise scale.

    Phase 0 runs at ``initial_batch`` ``B0``. During each phase the driver estimates the
    noise scale ``B_noise`` (:class:`dataflow.schedule.noise_scale.NoiseScaleTracker`, the
    critical batch size of McCandlish et al. 2018). At the boundary the wanted batch is
    the smaller of ``target × B_noise`` and, with ``min_efficiency`` (default 0.8), the
    largest batch that keeps that fraction of the small batch's progress per sample,
    ``(B0 + B_noise)/min_efficiency − B_noise`` (:meth:`efficient_batch`; 20 + B_noise/4
    at B0 = 16). It is clamped to ``[B_prev, min(B_prev × max_growth, max_batch)]`` and
    rounded down to a multiple of ``batch_multiple``; with ``may_shrink`` (default True)
    a wanted batch below ``B_prev`` is followed down, by at most ``÷max_growth`` per
    phase and never below ``B0`` (rounded up to a multiple). Without a trusted estimate
    the batch stays at ``B_prev``. ``target=1`` trains at the critical batch (about 2×
    the minimum steps and 2× the minimum samples); a smaller target favours samples, a
    larger one steps.

    Why the efficiency bound: one step at ``B`` with AdaScale's gain ``r`` does the
    work of ``r`` steps at ``B0``, so an epoch at ``B`` does ``r B0/B = (B0 + B_noise)/
    (B + B_noise)`` of an epoch at ``B0``'s progress. At ``target=1`` alone that is about
    one half: fine when the small batch has epochs to spare, but at equal epochs a task
    that is still learning at the end (a regression, a noisy 1D signal) ends ~2 to 17
    points lower (benchmarks/bench_adaptive_heldout.py). With 0.8 the batch still grows
    to ``≈ B_noise/4`` where noise dominates (e.g. 16 → 70 at ``B_noise = 200``), and
    stays near ``B0`` where it does not (the step savings then are small, honestly so).
    Why shrinking: the noise scale is not monotone (in a regression it can fall from
    ~100 in the first epochs to ~5 once the coarse fit is done), and a batch that can
    never come back down locks in an early overestimate for the rest of the fit.
    ``min_efficiency=None, may_shrink=False`` is the earlier rule (target alone,
    monotone batch). ``confirm_growth=True`` (default off) grows only toward the smaller
    of the last two estimates, so a one-phase spike is not followed.

    An estimate is trusted once it rests on at least ``min_measured_steps`` measured
    steps (default 20, about the tracker's smoothing horizon): an estimate from a few
    steps can be off by orders of magnitude, and acting on it would set a batch that is
    far too big. Until then the batch and the LR are
    kept (``noise_scale`` of the phase is None) and measuring goes on.

    Phase length: ``epochs_per_phase`` epochs (default 1), or ``steps_per_phase=N``: the
    phase spans the smallest whole number of epochs that holds at least ``N`` optimizer
    steps at that phase's global batch ``B``, i.e. ``ceil(N / s)`` epochs with
    ``s = ceil(n / B)`` steps per epoch (``floor`` with ``drop_last``; ``n`` samples per
    epoch), at least 1 and cut at the end of the fit. Phases stay whole epochs: a
    phase of 100 steps on an epoch of 30 steps at its batch lasts 4 epochs (120 steps);
    as the batch grows, epochs have fewer steps and phases more epochs. ``n`` is
    ``samples_per_epoch`` when given, else the engine's (``num_samples`` and
    ``drop_last`` passed to :meth:`next_phase`, see ``needs_epoch_size``).

    The LR is ``lr_scale`` times the base LR (``lr``, or the optimizer factory's; ``lr``
    is the first param group's, and each other group keeps its ratio to the first),
    which belongs to ``initial_batch``:

    - ``"adascale"``: AdaScale's gain ``(1 + B_noise/B0)/(1 + B_noise/B)``
      (:func:`dataflow.schedule.noise_scale.adascale_gain`), between 1 and ``B/B0``: linear
      scaling while noise dominates, less once the batch nears the noise scale. The
      gain is recomputed at each boundary from the latest estimate (measured at the
      previous batch, close to the new one since growth is bounded); without a trusted
      estimate the previous phase's scale is kept.
    - ``"adascale-sqrt"``: the square root of that gain, between 1 and ``sqrt(B/B0)``
      (the sqrt rule's analogue for Adam-like optimizers, whose RMS normalisation
      already grows the step as the batch cuts the noise). Measured at equal epochs it
      did worse than ``"adascale"`` with Adam too (fewer, smaller steps: less progress),
      so it is not the default.
    - ``"linear"``, ``"sqrt"``, ``"none"``: the Stepwise rules on ``B/B0``.

    Every rule is capped at ``max_lr_scale`` when given. Each phase after the first
    ramps to its new LR over ``warmup_steps`` steps.

    ``measure_every``: the engine measures the noise on every ``k``-th step of the fit
    (by step index). ``"auto"`` (default) picks ``k`` per phase from its steps ``S``:
    ``max(1, S // 60)``, every step of a phase under 120 steps and at least 60 measured
    steps in a longer one, where the tracker's estimate is within 10 % of the variance of
    measuring every step (see ``measured_lr.AUTO_MEASURED_PER_PHASE``). An int measures every
    ``k``-th step whatever the phase; ``min_measured_steps`` counts measured steps, so
    phases shorter than ``k × min_measured_steps`` then wait for later phases' steps.

    ``scale_invariant=True`` counts the fit's ``epochs`` in AdaScale's progress at
    ``B0``, as ``Stepwise(scale_invariant=True)`` does: a phase at batch ``B`` makes
    ``r·B0/B`` epochs of progress per epoch of data (``r``: AdaScale's gain at the
    estimate the phase was chosen from, whatever ``lr_rule``), phases keep their length
    in epochs of data, the last is cut to the whole epochs that reach ``epochs``, an LR
    decay follows the progress, and the fit ends once the progress is made. The
    efficiency bound then no longer guards the score (a batch that buys less per sample
    trains for more epochs): ``min_efficiency=None`` grows to ``target × B_noise``.
    """

    measures_noise: ClassVar[bool] = True

    initial_batch: int
    max_batch_size: int
    epochs_per_phase: int | None
    steps_per_phase: int | None
    samples_per_epoch: int | None
    max_growth: float
    target: float
    lr_rule: str
    lr: float | None
    warmup_steps: int
    batch_multiple: int
    max_lr_scale: float | None
    min_measured_steps: int
    confirm_growth: bool
    min_efficiency: float | None
    may_shrink: bool
    measure_every: int | str
    scale_invariant: bool

    def __init__(
        self,
        initial_batch: int,
        *,
        max_batch: int,
        epochs_per_phase: int | None = None,
        steps_per_phase: int | None = None,
        samples_per_epoch: int | None = None,
        max_growth: float = 2.0,
        target: float = 1.0,
        lr_rule: str = "adascale",
        lr: float | None = None,
        warmup_steps: int = 0,
        batch_multiple: int = 1,
        max_lr_scale: float | None = None,
        min_measured_steps: int = DEFAULT_MIN_MEASURED_STEPS,
        confirm_growth: bool = False,
        min_efficiency: float | None = 0.8,
        may_shrink: bool = True,
        measure_every: int | str = "auto",
        scale_invariant: bool = False,
    ) -> None:
        # A dataclass field cannot be called max_batch: that is the protocol's method.
        values = {
            "initial_batch": initial_batch,
            "max_batch_size": max_batch,
            "epochs_per_phase": epochs_per_phase,
            "steps_per_phase": steps_per_phase,
            "samples_per_epoch": samples_per_epoch,
            "max_growth": max_growth,
            "target": target,
            "lr_rule": lr_rule,
            "lr": lr,
            "warmup_steps": warmup_steps,
            "batch_multiple": batch_multiple,
            "max_lr_scale": max_lr_scale,
            "min_measured_steps": min_measured_steps,
            "confirm_growth": confirm_growth,
            "min_efficiency": min_efficiency,
            "may_shrink": may_shrink,
            "measure_every": measure_every,
            "scale_invariant": scale_invariant,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate()

    @property
    def counts_progress(self) -> bool:
        """Whether the fit's ``epochs`` count scale-invariant progress (the fit then ends
        when :meth:`next_phase` has no phase left, not at an epoch of data)."""
        return self.scale_invariant

    @property
    def needs_epoch_size(self) -> bool:
        """True when the engine must pass ``num_samples`` (and ``drop_last``) to
        :meth:`next_phase`: phases counted in steps, without ``samples_per_epoch``."""
        return self.steps_per_phase is not None and self.samples_per_epoch is None

    def _validate(self) -> None:
        _positive_int("Adaptive", "initial_batch", self.initial_batch)
        _positive_int("Adaptive", "max_batch", self.max_batch_size)
        _positive_int("Adaptive", "batch_multiple", self.batch_multiple)
        if self.max_batch_size < self.initial_batch:
            raise BatchSizeError(
                f"Adaptive(initial_batch={self.initial_batch}, max_batch={self.max_batch_size}): "
                "max_batch must be >= initial_batch"
            )
        if self.initial_batch % self.batch_multiple:
            fix = _round_down(self.initial_batch, self.batch_multiple) or self.batch_multiple
            raise BatchSizeError(
                f"Adaptive(initial_batch={self.initial_batch}, batch_multiple="
                f"{self.batch_multiple}): initial_batch must be a multiple of batch_multiple, "
                f"e.g. Adaptive({fix}, ...)"
            )
        if self.epochs_per_phase is not None and self.steps_per_phase is not None:
            raise ConfigError(
                f"Adaptive(epochs_per_phase={self.epochs_per_phase}, steps_per_phase="
                f"{self.steps_per_phase}): give the phase length one way, in epochs or in steps"
            )
        for name, what in (
            ("epochs_per_phase", "the batch can change once per phase"),
            ("steps_per_phase", "the optimizer steps a phase holds at least"),
            ("samples_per_epoch", "the training source's sample count, e.g. len(x)"),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"Adaptive({name}={value!r}): must be an int >= 1 ({what})")
            if value < 1:
                raise ConfigError(f"Adaptive({name}={value}): must be >= 1 ({what})")
        if self.samples_per_epoch is not None and self.steps_per_phase is None:
            raise ConfigError(
                f"Adaptive(samples_per_epoch={self.samples_per_epoch}): only used to count "
                "steps_per_phase; give steps_per_phase=... too, or leave it out"
            )
        _finite_number("Adaptive", "max_growth", self.max_growth)
        if self.max_growth < 1:
            raise ConfigError(
                f"Adaptive(max_growth={self.max_growth}): must be >= 1, the largest factor "
                "the batch may grow by in one phase (the batch never shrinks), e.g. 2.0"
            )
        _finite_number("Adaptive", "target", self.target)
        if not self.target > 0:
            raise ConfigError(
                f"Adaptive(target={self.target}): must be > 0, the next batch as a multiple "
                "of the measured noise scale (1.0 = the critical batch)"
            )
        if self.lr_rule not in ADAPTIVE_LR_RULES:
            raise ConfigError(
                f"Adaptive(lr_rule={self.lr_rule!r}): use one of {list(ADAPTIVE_LR_RULES)}"
            )
        if self.lr is not None:
            _finite_number("Adaptive", "lr", self.lr)
            if not self.lr > 0:
                raise ConfigError(f"Adaptive(lr={self.lr}): lr must be > 0 or None")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ConfigError(f"Adaptive(warmup_steps={self.warmup_steps!r}): must be an int >= 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"Adaptive(warmup_steps={self.warmup_steps}): must be >= 0")
        if self.max_lr_scale is not None:
            _finite_number("Adaptive", "max_lr_scale", self.max_lr_scale)
            if self.max_lr_scale < 1:
                raise ConfigError(
                    f"Adaptive(max_lr_scale={self.max_lr_scale}): must be >= 1 or None; it "
                    "caps the LR relative to the base LR at initial_batch"
                )
        check_measuring("Adaptive", self.measure_every, self.min_measured_steps)
        if self.min_efficiency is not None:
            _finite_number("Adaptive", "min_efficiency", self.min_efficiency)
            if not 0 < self.min_efficiency <= 1:
                raise ConfigError(
                    f"Adaptive(min_efficiency={self.min_efficiency}): must be in (0, 1] or "
                    "None, the least progress per sample kept relative to initial_batch"
                )
        for flag in ("confirm_growth", "may_shrink", "scale_invariant"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(
                    f"Adaptive({flag}={getattr(self, flag)!r}): must be True or False"
                )

    def __repr__(self) -> str:
        length = (
            f"steps_per_phase={self.steps_per_phase}, samples_per_epoch={self.samples_per_epoch}"
            if self.steps_per_phase is not None
            else f"epochs_per_phase={self.epochs_per_phase or 1}"
        )
        return (
            f"Adaptive({self.initial_batch}, max_batch={self.max_batch_size}, {length}, "
            f"max_growth={self.max_growth}, target={self.target}, lr_rule={self.lr_rule!r}, "
            f"lr={self.lr}, warmup_steps={self.warmup_steps}, "
            f"batch_multiple={self.batch_multiple}, max_lr_scale={self.max_lr_scale}, "
            f"min_measured_steps={self.min_measured_steps}, "
            f"confirm_growth={self.confirm_growth}, "
            f"min_efficiency={self.min_efficiency}, may_shrink={self.may_shrink}, "
            f"measure_every={self.measure_every!r})"
        )

    def measure_interval(self, phase_steps: int) -> int:
        """Measure the noise on every k-th step of a phase of ``phase_steps`` steps: the
        int ``measure_every``, or with ``"auto"`` ``max(1, phase_steps // 60)``."""
        return measure_interval(self.measure_every, phase_steps)

    def next_batch(self, previous: int, noise_scale: float | None) -> int:
        """The batch after a phase at ``previous`` that measured ``noise_scale``."""
        if noise_scale is None:
            return previous
        ceiling = min(previous * self.max_growth, self.max_batch_size)
        wanted = self.target * noise_scale
        if self.min_efficiency is not None:
            wanted = min(wanted, self.efficient_batch(noise_scale))
        if self.may_shrink and wanted < previous:
            # down to the wanted batch, at most ÷max_growth, never below initial_batch;
            # rounded up to a multiple (initial_batch is one)
            floor = max(wanted, previous / self.max_growth, self.initial_batch)
            multiple = self.batch_multiple
            return min(math.ceil(floor / multiple) * multiple, previous)
        wanted = min(max(wanted, previous), ceiling)
        return max(_round_down(int(wanted), self.batch_multiple), previous)

    def efficiency(self, batch: float, noise_scale: float) -> float:
        """Progress per sample at ``batch`` relative to ``initial_batch`` ``B0``:
        ``(B0 + B_noise)/(batch + B_noise)``, Pollux's statistical efficiency (1 at ``B0``;
        see :meth:`efficient_batch`)."""
        return statistical_efficiency(batch, noise_scale, self.initial_batch)

    def efficient_batch(self, noise_scale: float) -> float:
        """The largest batch whose progress per sample is at least ``min_efficiency``
        times that at ``initial_batch`` ``B0``, given the noise scale ``Bn``.

        One step at ``B`` with AdaScale's gain does the work of ``r = (1 + Bn/B0) /
        (1 + Bn/B)`` steps at ``B0`` (McCandlish et al.'s model), so per sample it keeps
        ``r B0 / B = (B0 + Bn) / (B + Bn)`` of the small batch's progress; that is at
        least ``e`` up to ``B = (B0 + Bn)/e - Bn``. Infinite without ``min_efficiency``."""
        if self.min_efficiency is None:
            return math.inf
        return (self.initial_batch + noise_scale) / self.min_efficiency - noise_scale

    def lr_scale(self, batch: int, noise_scale: float | None, previous: float = 1.0) -> float:
        """The LR scale at ``batch`` (relative to the base LR at ``initial_batch``);
        ``previous`` is kept by "adascale" when there is no estimate."""
        rule = self.lr_rule
        if rule in ADASCALE_RULES:
            scale = adascale_scale(rule, noise_scale, self.initial_batch, batch, previous)
        else:
            scale = LR_RULES[rule](batch / self.initial_batch)
        if self.max_lr_scale is not None:
            scale = min(scale, self.max_lr_scale)
        return scale

    @staticmethod
    def measured_steps(measured: PhaseMeasurement, previous: PhaseSpec) -> int | None:
        """The steps ``measured``'s estimate rests on
        (:func:`dataflow.schedule.measured_lr.measured_steps`)."""
        return measured_steps(measured, previous)

    def trusted_noise_scale(
        self, measured: PhaseMeasurement | None, previous: PhaseSpec
    ) -> float | None:
        """The estimate the next phase is chosen from: None without one, or while it rests
        on fewer than ``min_measured_steps`` measured steps."""
        return trusted_noise_scale(measured, previous, self.min_measured_steps)

    def growth_estimate(self, noise_scale: float | None, previous: PhaseSpec) -> float | None:
        """The estimate the batch grows toward: ``noise_scale`` (the latest trusted one),
        or with ``confirm_growth`` the smaller of it and the estimate ``previous`` was
        chosen from (when there was one): the batch never shrinks, so it follows a rise
        only once two consecutive phases measured it."""
        if noise_scale is None or not self.confirm_growth or previous.noise_scale is None:
            return noise_scale
        return min(noise_scale, previous.noise_scale)

    def phase_epochs(
        self, batch: int, num_samples: int | None = None, drop_last: bool = False
    ) -> int:
        """Epochs in a phase at global batch ``batch`` (before the cut at the fit's end)."""
        if self.steps_per_phase is None:
            return self.epochs_per_phase or 1
        if self.samples_per_epoch is not None:
            num_samples, drop_last = self.samples_per_epoch, False
        if num_samples is None:
            raise ConfigError(
                f"Adaptive(steps_per_phase={self.steps_per_phase}): counting a phase in steps "
                "needs the samples per epoch; pass samples_per_epoch=<training samples> "
                "(this engine did not give the schedule the source's size)"
            )
        per_epoch = steps_per_epoch(num_samples, batch, drop_last=drop_last)
        if per_epoch == 0:  # a batch beyond the data with drop_last: the engine refuses it
            return 1
        return max(1, math.ceil(self.steps_per_phase / per_epoch))

    def next_phase(
        self,
        *,
        start_epoch: int,
        total_epochs: int,
        previous: PhaseSpec | None,
        measured: PhaseMeasurement | None = None,
        num_samples: int | None = None,
        drop_last: bool = False,
    ) -> PhaseSpec | None:
        """The next phase; ``num_samples`` and ``drop_last`` (the training source's
        samples per epoch and the Load stage's option) count ``steps_per_phase``.
        Counting progress (``scale_invariant``), ``total_epochs`` is progress, and None
        says the fit is done."""
        done = progress_so_far(previous) if self.scale_invariant else None
        if done is not None and progress_made(done, total_epochs):
            return None
        if previous is None:
            batch, scale, noise, gain = self.initial_batch, 1.0, None, 1.0
        else:
            noise = self.trusted_noise_scale(measured, previous)
            batch = self.next_batch(previous.global_batch, self.growth_estimate(noise, previous))
            scale = self.lr_scale(batch, noise, previous.lr_scale)
            gain = statistical_gain(noise, self.initial_batch, batch, previous)
        epochs, progress = self.phase_epochs(batch, num_samples, drop_last), {}
        if done is None:
            epochs = min(epochs, total_epochs - start_epoch)
        else:  # the last phase cut to the whole epochs that reach the fit's progress
            epochs, progress = phase_progress(
                done, total_epochs, gain, self.initial_batch, batch, most=epochs
            )
        return PhaseSpec(
            index=0 if previous is None else previous.index + 1,
            start_epoch=start_epoch,
            end_epoch=start_epoch + epochs,
            global_batch=batch,
            lr=None if self.lr is None else self.lr * scale,
            lr_scale=scale,
            warmup_steps=0 if previous is None else self.warmup_steps,
            noise_scale=noise,
            gain=scale,
            **progress,
        )

    def max_batch(self) -> int:
        return self.max_batch_size
