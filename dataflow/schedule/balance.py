"""Split a global batch into per-replica local batches (pure functions).

The split is integers that sum exactly to the global batch. Any split is exact:
the allreduce weights each replica's gradient by ``b_r / B``. Replicas given a
larger share finish their local work in the same time as faster ones would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dataflow.core.errors import ConfigError
from dataflow.core.protocols import Balancer as Balancer  # the contract, re-exported


def proportional_split(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainder).

    Ties in the remainders go to the lower rank, so the split is deterministic.
    """
    if total < 0:
        raise ConfigError(f"proportional_split: total must be >= 0, got {total}")
    if not weights:
        raise ConfigError("proportional_split: weights is empty; need one per replica")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"proportional_split: weights must be >= 0 with a positive sum, got {list(weights)}"
        )
    weight_sum = float(sum(weights))
    exact = [w / weight_sum * total for w in weights]  # divide first: tiny weights stay finite
    shares = [int(e) for e in exact]
    short = total - sum(shares)
    by_remainder = sorted(range(len(weights)), key=lambda r: (-(exact[r] - shares[r]), r))
    for r in by_remainder[:short]:
        shares[r] += 1
    return tuple(shares)


def micro_batch_counts(
    local_batches: Sequence[int],
    cap: int | Sequence[int | None] | None,
    *,
    minimum: int = 1,
) -> tuple[int, ...]:
    """Per replica, how many micro-batches its local batch is run in.

    ``cap`` is the most samples one forward/backward may hold in memory (one value,
    or one per replica; None: no cap). A replica whose local batch exceeds its cap
    accumulates gradients over ``ceil(b_r / cap)`` micro-batches, so any global batch
    fits any device. ``minimum`` forces accumulation (the noise-scale estimate of a
    single replica needs two micro-batches); a batch is never cut finer than one
    sample per micro-batch.
    """
    caps = list(cap) if isinstance(cap, list | tuple) else [cap] * len(local_batches)
    if len(caps) != len(local_batches):
        raise ConfigError(
            f"max_micro_batch has {len(caps)} values but the fit has {len(local_batches)} "
            "replicas; give one int for all, or one per replica"
        )
    counts = []
    for batch, limit in zip(local_batches, caps, strict=True):
        count = 1 if limit is None else -(-batch // limit)
        counts.append(max(1, min(batch, max(count, minimum))))
    return tuple(counts)


def smoothed_speeds(
    measured: Sequence[Sequence[float]], replicas: int, smoothing: float
) -> list[float]:
    """Per replica, an exponential moving average of its measured samples/s over phases
    (weight ``smoothing`` on the newest). A replica with no positive measurement yet
    (new, or idle) gets the mean of the others, hence an even share; none measured at
    all gives equal speeds."""
    speeds: list[float | None] = [None] * replicas
    for phase in measured:
        for r in range(min(replicas, len(phase))):
            value = float(phase[r])
            if value > 0:
                old = speeds[r]
                speeds[r] = value if old is None else smoothing * value + (1 - smoothing) * old
    known = [v for v in speeds if v is not None]
    fill = sum(known) / len(known) if known else 1.0
    return [fill if v is None else v for v in speeds]


@dataclass(frozen=True)
class Even:
    """Equal shares (the remainder to the lowest ranks): the default."""

    def split(
        self, global_batch: int, replicas: int, measured: Sequence[Sequence[float]] = ()
    ) -> tuple[int, ...]:
        return proportional_split(global_batch, [1.0] * replicas)


@dataclass(frozen=True)
class Proportional:
    """Fixed shares proportional to ``weights`` (one per replica), e.g. ``(1, 3)``.

    Useful when the relative speeds are known up front (a GPU and a CPU replica).
    """

    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if not self.weights or any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ConfigError(
                f"Proportional(weights={self.weights}): weights must be >= 0, one per "
                "replica, with a positive sum"
            )

    def split(
        self, global_batch: int, replicas: int, measured: Sequence[Sequence[float]] = ()
    ) -> tuple[int, ...]:
        if len(self.weights) != replicas:
            raise ConfigError(
                f"Proportional(weights={self.weights}) has {len(self.weights)} weights but the "
                f"fit has {replicas} replicas; give one weight per replica"
            )
        return proportional_split(global_batch, self.weights)


@dataclass(frozen=True)
class Throughput:
    """Shares proportional to each replica's measured samples/s over the past phases
    (smoothed: ``smoothing`` is the weight of the newest phase), so a slow or shared
    node gets a smaller share and no longer holds every step back. The first phase,
    with nothing measured, is split evenly. The data shares follow the same split.
    """

    smoothing: float = 0.7

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ConfigError(
                f"Throughput(smoothing={self.smoothing}): the weight of the newest phase's "
                "measurement, in (0, 1]"
            )

    def split(
        self, global_batch: int, replicas: int, measured: Sequence[Sequence[float]] = ()
    ) -> tuple[int, ...]:
        return proportional_split(global_batch, smoothed_speeds(measured, replicas, self.smoothing))
