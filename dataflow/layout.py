"""How the fit's workers form replicas: a replica is a group of workers.

Today every group holds one worker (sample parallelism). Spatial decomposition
will put several workers in one group, each holding a region of every sample; the
driver already speaks of replicas as groups, so a lost worker loses its group.
Pure data.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """``groups[r]``: the workers of replica ``r``; the first of each is its leader (the
    worker its tasks are pinned to)."""

    groups: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def sample_parallel(cls, workers: Iterable[str]) -> Layout:
        """One replica per worker, in order."""
        return cls(tuple((w,) for w in workers))

    @property
    def replicas(self) -> int:
        return len(self.groups)

    @property
    def leaders(self) -> tuple[str, ...]:
        return tuple(group[0] for group in self.groups)

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(w for group in self.groups for w in group)

    def lost_replicas(self, lost: Iterable[str]) -> tuple[int, ...]:
        """The replicas with a worker in ``lost`` (one lost worker loses its group)."""
        gone = set(lost)
        return tuple(r for r, group in enumerate(self.groups) if gone.intersection(group))

    def without(self, replicas: Iterable[int]) -> Layout:
        drop = set(replicas)
        return Layout(tuple(g for r, g in enumerate(self.groups) if r not in drop))

    def plus(self, other: Layout) -> Layout:
        return Layout(self.groups + other.groups)
