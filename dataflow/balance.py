"""Split a global batch into per-replica local batches (pure functions).

The split is integers that sum exactly to the global batch. Any split is exact:
the allreduce weights each replica's gradient by ``b_r / B``. Replicas given a
larger share finish their local work in the same time as faster ones would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dataflow.errors import ConfigError


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


@runtime_checkable
class Balancer(Protocol):
    """Chooses the per-replica split of each global batch."""

    def split(self, global_batch: int, replicas: int) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Even:
    """Equal shares (the remainder to the lowest ranks): the default."""

    def split(self, global_batch: int, replicas: int) -> tuple[int, ...]:
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

    def split(self, global_batch: int, replicas: int) -> tuple[int, ...]:
        if len(self.weights) != replicas:
            raise ConfigError(
                f"Proportional(weights={self.weights}) has {len(self.weights)} weights but the "
                f"fit has {replicas} replicas; give one weight per replica"
            )
        return proportional_split(global_batch, self.weights)
