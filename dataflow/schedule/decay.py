"""The learning rate over the whole fit: a warmup at its start and a decay towards its
end, as a factor on every step's LR.

The schedule (``Fixed``, ``Stepwise``, ``Adaptive``) decides each phase's batch and LR;
an ``LRDecay`` multiplies the LR of each step by ``factor(progress)``, where
``progress`` is how far the fit has come in epochs (samples seen / samples per
epoch). Epochs, not steps: when the batch grows, a step covers more samples, and the
decay follows the data the model has seen, as it would at a fixed batch. The factor
is a pure function of the step's place in its epoch, so a fit resumed, recovered or
re-split runs every step at the LR it had uninterrupted.

Pure: no torch, Dask or zarr.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from dataflow.core.errors import ConfigError
from dataflow.schedule.rules import _finite_number as _number

__all__ = ["CosineDecay", "LRDecay", "PolynomialDecay", "StepDecay", "Warmup"]


@dataclass(frozen=True, kw_only=True)
class LRDecay:
    """A warmup over the first ``warmup_epochs`` (the factor ramps linearly from
    ``warmup_start`` to 1; large batches need it: Goyal et al. 2017), then the decay of
    the subclass. Subclasses define :meth:`decay`."""

    warmup_epochs: float = 0.0
    warmup_start: float = 0.0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if _number(owner, "warmup_epochs", self.warmup_epochs) < 0:
            raise ConfigError(f"{owner}(warmup_epochs={self.warmup_epochs}): must be >= 0")
        start = _number(owner, "warmup_start", self.warmup_start)
        if not 0 <= start <= 1:
            raise ConfigError(
                f"{owner}(warmup_start={self.warmup_start}): the warmup's first factor on "
                "the LR, between 0 and 1 (e.g. 0.1: the fit starts at a tenth of the LR)"
            )

    def factor(self, progress: float, total_epochs: int) -> float:
        """The factor on the LR of a step that begins ``progress`` epochs into a fit of
        ``total_epochs``."""
        ramp = 1.0
        if progress < self.warmup_epochs:
            ramp = self.warmup_start + (1.0 - self.warmup_start) * progress / self.warmup_epochs
        return ramp * self.decay(progress, total_epochs)

    def decay(self, progress: float, total_epochs: int) -> float:
        raise NotImplementedError

    def check(self, total_epochs: int) -> None:
        """Refuse a fit this decay cannot run over (called before the fit starts)."""

    def describe(self) -> str:
        warmup = f", warmup {self.warmup_epochs:g} epochs" if self.warmup_epochs else ""
        return f"{self._shape()}{warmup}"

    def _shape(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, kw_only=True)
class Warmup(LRDecay):
    """The warmup alone: the LR ramps up over ``warmup_epochs`` and then stays as the
    schedule sets it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.warmup_epochs > 0:
            raise ConfigError(
                f"Warmup(warmup_epochs={self.warmup_epochs}): give the epochs to ramp over, "
                "e.g. Warmup(warmup_epochs=5)"
            )

    def decay(self, progress: float, total_epochs: int) -> float:
        return 1.0

    def _shape(self) -> str:
        return "constant"


@dataclass(frozen=True)
class StepDecay(LRDecay):
    """The user's table ``{epoch: factor}``: from each listed epoch on, the LR is the
    schedule's times that factor (``StepDecay({30: 0.1, 60: 0.01})``, as ResNet-50 on
    ImageNet; MLPerf's CosmoFlow: ``{32: 0.25, 64: 0.125}``). Epochs may be fractions."""

    factors: dict[float, float]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.factors, dict) or not self.factors:
            raise ConfigError(
                f"StepDecay(factors={self.factors!r}): give a dict {{epoch: factor}}, e.g. "
                "StepDecay({30: 0.1, 60: 0.01})"
            )
        for epoch, value in self.factors.items():
            if _number("StepDecay", f"factors key {epoch!r}", epoch) < 0:
                raise ConfigError(f"StepDecay(factors=...): epoch {epoch} must be >= 0")
            if not _number("StepDecay", f"factors[{epoch!r}]", value) >= 0:
                raise ConfigError(f"StepDecay(factors=...): the factor at epoch {epoch} is < 0")

    def decay(self, progress: float, total_epochs: int) -> float:
        epochs = sorted(self.factors)
        at = bisect.bisect_right(epochs, progress)
        return 1.0 if at == 0 else float(self.factors[epochs[at - 1]])

    def _shape(self) -> str:
        return "step " + ", ".join(f"x{self.factors[e]:g} at {e:g}" for e in sorted(self.factors))


@dataclass(frozen=True, kw_only=True)
class _ToTheEnd(LRDecay):
    """A decay from the end of the warmup to ``final`` x the LR at the fit's last epoch
    (or at ``epochs``: a fixed horizon, so a fit resumed with more epochs keeps the curve
    it began on)."""

    final: float = 0.0
    epochs: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if not 0 <= _number(owner, "final", self.final) <= 1:
            raise ConfigError(
                f"{owner}(final={self.final}): the last factor on the LR, between 0 and 1"
            )
        if self.epochs is not None and not _number(owner, "epochs", self.epochs) > 0:
            raise ConfigError(f"{owner}(epochs={self.epochs}): must be > 0, or None (the fit's)")

    def check(self, total_epochs: int) -> None:
        horizon = self.epochs if self.epochs is not None else total_epochs
        if horizon <= self.warmup_epochs:
            owner = type(self).__name__
            raise ConfigError(
                f"{owner}(warmup_epochs={self.warmup_epochs}) over {horizon:g} epochs leaves "
                f"nothing to decay over: give {owner}(epochs=...) or fit(epochs=...) more "
                "epochs than the warmup, or a shorter warmup"
            )

    def decay(self, progress: float, total_epochs: int) -> float:
        horizon = self.epochs if self.epochs is not None else total_epochs
        span = horizon - self.warmup_epochs
        done = min(1.0, max(0.0, (progress - self.warmup_epochs) / span)) if span > 0 else 1.0
        return self.final + (1.0 - self.final) * self.shape(done)

    def shape(self, done: float) -> float:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class CosineDecay(_ToTheEnd):
    """Half a cosine from 1 to ``final`` (Loshchilov and Hutter 2017)."""

    def shape(self, done: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * done))

    def _shape(self) -> str:
        return f"cosine to x{self.final:g}"


@dataclass(frozen=True, kw_only=True)
class PolynomialDecay(_ToTheEnd):
    """``(1 - done) ** power`` from 1 to ``final``: ``power=1`` is a straight line,
    ``power=2`` the decay large-batch LARS training of ResNet-50 uses."""

    power: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _number("PolynomialDecay", "power", self.power) > 0:
            raise ConfigError(f"PolynomialDecay(power={self.power}): must be > 0")

    def shape(self, done: float) -> float:
        return (1.0 - done) ** self.power

    def _shape(self) -> str:
        return f"polynomial (power {self.power:g}) to x{self.final:g}"
