"""One replica's compute time as a function of its local batch, and its memory.

Compute is fitted from a few measured batch sizes: between measured sizes it follows
the measurements (piecewise linear), beyond them the straight line of the nearest two,
never below the measured time of the smaller batch (a larger batch never runs faster).
Pure: no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from dataflow.core.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ComputeFit:
    """Seconds of one optimizer step's forward + backward + update on one replica.

    ``points``: measured ``(local batch, seconds)`` pairs, batch sizes distinct.
    ``backward_fraction``: the share of a step spent in backward (the time the
    gradient allreduce can hide behind; about 2/3 for CNNs, calibration measures it).
    ``shared``: measured ``(replicas busy on one node, slowdown)`` pairs: how much
    slower a step runs while that many replicas compute on the node at once (they
    share its cores' caches, memory bandwidth, SMT siblings and whatever else runs
    there); none: 1 (every replica as fast as one alone). Beyond the last measured
    count the last slowdown holds.
    """

    points: tuple[tuple[int, float], ...]
    backward_fraction: float = 2 / 3
    source: str = ""
    shared: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("ComputeFit(points=...): give at least one (batch, seconds) pair")
        batches = [b for b, _ in self.points]
        if len(set(batches)) != len(batches):
            raise ConfigError(f"ComputeFit(points=...): batch sizes repeat in {batches}")
        for batch, seconds in self.points:
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
                raise ConfigError(f"ComputeFit: batch {batch!r} must be an int >= 1")
            if not math.isfinite(seconds) or seconds <= 0:
                raise ConfigError(f"ComputeFit: seconds {seconds!r} at batch {batch} must be > 0")
        if not 0 <= self.backward_fraction <= 1:
            raise ConfigError(
                f"ComputeFit(backward_fraction={self.backward_fraction}): must be in [0, 1]"
            )
        object.__setattr__(self, "points", tuple(sorted(self.points)))
        for count, factor in self.shared:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"ComputeFit(shared=...): replicas {count!r} must be an int >= 1")
            if not math.isfinite(factor) or factor <= 0:
                raise ConfigError(f"ComputeFit(shared=...): slowdown {factor!r} must be > 0")
        object.__setattr__(
            self, "shared", tuple(sorted((int(k), float(f)) for k, f in self.shared))
        )

    def slowdown(self, replicas_on_node: int) -> float:
        """How much slower a step runs with ``replicas_on_node`` replicas computing on
        one node at once (``shared``; linear between measured counts, 1 for one alone)."""
        pts = [(1, 1.0), *((k, f) for k, f in self.shared if k > 1)]
        if replicas_on_node <= 1 or len(pts) == 1:
            return 1.0
        for (k0, f0), (k1, f1) in itertools.pairwise(pts):
            if replicas_on_node <= k1:
                return f0 + (f1 - f0) * (replicas_on_node - k0) / (k1 - k0)
        return pts[-1][1]

    @classmethod
    def linear(cls, *, fixed_s: float, per_sample_s: float, **kwargs) -> ComputeFit:
        """``t(b) = fixed_s + per_sample_s × b`` (a preset's published throughput)."""
        return cls(points=((1, fixed_s + per_sample_s), (2, fixed_s + 2 * per_sample_s)), **kwargs)

    @classmethod
    def from_throughput(
        cls, samples_per_second: float, *, batch: int, fixed_s: float = 0.0, **kwargs
    ) -> ComputeFit:
        """A device that trains ``samples_per_second`` at local ``batch`` (and scales
        linearly around it, plus ``fixed_s`` per step)."""
        per_sample = 1.0 / samples_per_second
        return cls.linear(fixed_s=fixed_s, per_sample_s=per_sample - fixed_s / batch, **kwargs)

    def seconds(self, batch: float) -> float:
        """Predicted seconds of one step at local ``batch`` (0 samples: 0 s)."""
        if batch <= 0:
            return 0.0
        pts = self.points
        if len(pts) == 1:
            b0, t0 = pts[0]
            return t0 * batch / b0
        if batch <= pts[0][0]:
            (b0, t0), (b1, t1) = pts[0], pts[1]
            slope = max(0.0, (t1 - t0) / (b1 - b0))
            return max(t0 * batch / b0, t0 - slope * (b0 - batch))
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if batch <= b1:
                return max(t0, t0 + (t1 - t0) * (batch - b0) / (b1 - b0))
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        slope = max(0.0, (t1 - t0) / (b1 - b0))
        if slope == 0.0:
            slope = t1 / b1
        return t1 + slope * (batch - b1)

    def micro_batched_seconds(self, batch: int, max_micro_batch: int | None) -> tuple[float, int]:
        """(seconds, micro-batches) of a step at ``batch`` with gradient accumulation in
        micro-batches of at most ``max_micro_batch`` samples."""
        if batch <= 0:
            return 0.0, 0
        if max_micro_batch is None or batch <= max_micro_batch:
            return self.seconds(batch), 1
        count = math.ceil(batch / max_micro_batch)
        full, rest = divmod(batch, count)
        # as the engine splits: `rest` micro-batches of full + 1, the others of full
        return rest * self.seconds(full + 1) + (count - rest) * self.seconds(full), count


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Bytes one replica holds: weights, gradients, the gradient buckets and the
    optimizer's state (``optimizer_states`` copies of the weights: 1 for SGD with
    momentum, 2 for Adam), plus ``activation_bytes_per_sample`` for each sample of a
    micro-batch (what forward saves for backward)."""

    parameter_bytes: int
    activation_bytes_per_sample: int
    optimizer_states: int = 1

    def __post_init__(self) -> None:
        for name in ("parameter_bytes", "activation_bytes_per_sample", "optimizer_states"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"MemoryModel({name}={value!r}): must be an int >= 0")

    def bytes_per_replica(self, micro_batch: int) -> dict[str, int]:
        """The breakdown for one micro-batch of ``micro_batch`` samples."""
        p = self.parameter_bytes
        return {
            "weights": p,
            "gradients": p,
            "buckets": p,
            "optimizer": self.optimizer_states * p,
            "activations": self.activation_bytes_per_sample * max(0, micro_batch),
        }


def fit_line(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``y = a + b x`` (one point: through 0)."""
    pts = list(points)
    if not pts:
        raise ConfigError("fit_line: no points")
    if len(pts) == 1:
        x, y = pts[0]
        return 0.0, y / x if x else 0.0
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - slope * mx, slope
