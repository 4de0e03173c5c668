"""Simulated slow nodes, constant or moving: a replica's slow-down factor over wall time.

``Trainer(throttle={rank: ...})`` makes a replica take ``factor`` times its compute
time (each step sleeps ``(factor - 1)`` times what its compute stages took; the replica
applies it, :mod:`dataflow.runtime.replica`). A number is
a constant factor (a slower node). The two schedules here make the factor *move*, as a
shared node's does when a neighbour starts a job, a GPU throttles when hot, or a link is
slow for a minute, which is what asynchronous and local updates are meant to absorb
(BPT-CNN, Ji et al. 2019):

- :class:`SlowdownSchedule`: given factors from given seconds on, optionally repeating
  (``SlowdownSchedule.alternating(1.0, 3.0, every_s=3.0)``: 1x for 3 s, 3x for 3 s, ...);
- :class:`NoisyNeighbour`: a seeded random on/off process, off (1x) and on (a factor
  drawn from ``[low, high]``) for exponentially distributed spells.

Time is seconds since the fit began (the driver's clock when it sent the replicas their
spec). Both are pure and deterministic: ``factor_at(t)`` depends on ``t`` and the seed
only, so a test can check a schedule with made-up times, and two runs rehearse the same
neighbour.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dataflow.core.errors import ConfigError

__all__ = ["NoisyNeighbour", "Slowdown", "SlowdownSchedule", "as_slowdown"]


@runtime_checkable
class Slowdown(Protocol):
    """A replica's slow-down factor (>= 1) at ``t`` seconds since the fit began."""

    def factor_at(self, t: float) -> float: ...


@dataclass(frozen=True)
class Constant:
    factor: float

    def factor_at(self, t: float) -> float:
        return self.factor


@dataclass(frozen=True)
class SlowdownSchedule:
    """``points``: ``(seconds, factor)`` pairs, each factor holding from its second until
    the next point's (1.0 before the first); ``period_s``: the schedule repeats with this
    period (None: the last factor holds)."""

    points: tuple[tuple[float, float], ...]
    period_s: float | None = None
    _starts: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        points = tuple((float(t), float(f)) for t, f in self.points)
        times = [t for t, _ in points]
        if not points or times != sorted(times) or times[0] < 0:
            raise ConfigError(
                f"SlowdownSchedule(points={self.points!r}): give (seconds, factor) pairs in "
                "increasing seconds from 0, e.g. ((0, 1.0), (3, 3.0))"
            )
        if any(not f >= 1.0 for _, f in points):
            raise ConfigError(f"SlowdownSchedule(points={self.points!r}): factors must be >= 1")
        if self.period_s is not None and not self.period_s > times[-1]:
            raise ConfigError(
                f"SlowdownSchedule(period_s={self.period_s!r}): the period must be longer "
                f"than the last point ({times[-1]} s)"
            )
        object.__setattr__(self, "points", points)
        object.__setattr__(self, "_starts", tuple(times))

    @classmethod
    def alternating(cls, *factors: float, every_s: float) -> SlowdownSchedule:
        """Each of ``factors`` in turn for ``every_s`` seconds, repeating."""
        if len(factors) < 2 or not every_s > 0:
            raise ConfigError(
                "SlowdownSchedule.alternating(*factors, every_s=...): two factors or more "
                "and every_s > 0, e.g. alternating(1.0, 3.0, every_s=3.0)"
            )
        points = tuple((i * every_s, f) for i, f in enumerate(factors))
        return cls(points, period_s=len(factors) * every_s)

    def factor_at(self, t: float) -> float:
        if self.period_s is not None:
            t = math.fmod(max(t, 0.0), self.period_s)
        i = bisect.bisect_right(self._starts, t) - 1  # once per step: no list built
        return 1.0 if i < 0 else self.points[i][1]


@dataclass(frozen=True)
class NoisyNeighbour:
    """A neighbour who starts and stops jobs at random: off (1x) for an exponential spell
    of mean ``off_s`` seconds, then on at a factor drawn uniformly from ``[low, high]``
    for a spell of mean ``on_s``, and so on; ``seed`` fixes the whole history."""

    low: float = 2.0
    high: float = 3.0
    on_s: float = 3.0
    off_s: float = 3.0
    seed: int = 0
    # the spells drawn so far (start second, factor), extended as later times are asked
    _starts: list[float] = field(default_factory=list, init=False, repr=False, compare=False)
    _factors: list[float] = field(default_factory=list, init=False, repr=False, compare=False)
    _rng: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (1.0 <= self.low <= self.high) or not (self.on_s > 0 and self.off_s > 0):
            raise ConfigError(
                f"NoisyNeighbour(low={self.low}, high={self.high}, on_s={self.on_s}, "
                f"off_s={self.off_s}): need 1 <= low <= high and spells > 0 s"
            )
        self._restart()

    def _restart(self) -> None:
        """No spell drawn yet: the history starts over from the seed (off at 0 s)."""
        object.__setattr__(self, "_starts", [0.0])
        object.__setattr__(self, "_factors", [1.0])
        object.__setattr__(self, "_rng", random.Random(self.seed))

    def factor_at(self, t: float) -> float:
        starts, factors, rng = self._starts, self._factors, self._rng
        while starts[-1] <= t:
            off = factors[-1] == 1.0
            starts.append(starts[-1] + rng.expovariate(1.0 / (self.off_s if off else self.on_s)))
            factors.append(rng.uniform(self.low, self.high) if off else 1.0)
        return factors[bisect.bisect_right(starts, max(t, 0.0)) - 1]

    def __getstate__(self) -> dict[str, Any]:  # sent to the workers: the seed, not the draws
        return {"low": self.low, "high": self.high, "on_s": self.on_s, "off_s": self.off_s,
                "seed": self.seed}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        self._restart()


def as_slowdown(value: Any, where: str = "throttle") -> Slowdown:
    """A number (a constant factor >= 1) or a schedule, as a :class:`Slowdown`."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not float(value) >= 1.0:
            raise ConfigError(f"{where}: factor {value!r} must be >= 1")
        return Constant(float(value))
    if isinstance(value, Slowdown):
        return value
    raise ConfigError(
        f"{where}: {value!r} is neither a factor >= 1 nor a schedule; give e.g. 2.0, "
        "SlowdownSchedule.alternating(1.0, 3.0, every_s=3.0) or NoisyNeighbour(seed=0)"
    )
