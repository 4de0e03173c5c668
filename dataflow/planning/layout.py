"""How a fit's workers form replicas: the user's :class:`Layout`, and the groups the
driver forms from it (:class:`ReplicaGroups`). Pure data.

A replica is a group of workers. With ``Layout(spatial=P)`` each group holds ``P``
workers, each holding a region of every sample (spatial decomposition); the default,
``spatial=1``, is sample parallelism (one worker per replica). A lost worker loses its
group; the other workers of that group go back to the pool.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dataflow.core.errors import ConfigError
from dataflow.spatial.geometry import coords_of, grid_shape, split_extent


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Workers as sample groups x spatial ranks.

    ``spatial``: the workers that share each sample (1: sample parallelism). ``dims``:
    which spatial dimensions are split, counted from 0 = the first one after channels
    (depth of a ``(C, D, H, W)`` volume). ``grid``: ranks per split dimension, by
    default as square as ``spatial`` allows (4 over two dims: 2 x 2).
    """

    spatial: int = 1
    dims: tuple[int, ...] = (0,)
    grid: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.spatial, bool) or not isinstance(self.spatial, int) or self.spatial < 1:
            raise ConfigError(
                f"Layout(spatial={self.spatial!r}): the workers sharing each sample must be "
                "an integer >= 1 (1 = sample parallelism)"
            )
        dims = (self.dims,) if isinstance(self.dims, int) else tuple(self.dims)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
            raise ConfigError(
                f"Layout(dims={self.dims!r}): name the split spatial dimensions as integers "
                ">= 0 (0 = the first dimension after channels)"
            )
        if len(set(dims)) != len(dims):
            raise ConfigError(f"Layout(dims={self.dims!r}): a dimension is named twice")
        object.__setattr__(self, "dims", dims)
        grid = grid_shape(self.spatial, len(dims)) if self.grid is None else tuple(self.grid)
        product = 1
        for g in grid:
            product *= g
        if len(grid) != len(dims) or product != self.spatial or min(grid) < 1:
            raise ConfigError(
                f"Layout(grid={self.grid!r}): give one rank count per split dimension "
                f"{dims}, multiplying to spatial={self.spatial}"
            )
        object.__setattr__(self, "grid", grid)

    @property
    def tensor_dims(self) -> tuple[int, ...]:
        """The split dimensions of a batch tensor ``(N, C, *spatial)``."""
        return tuple(2 + d for d in self.dims)

    @property
    def sample_axes(self) -> tuple[int, ...]:
        """The split axes of one sample ``(C, *spatial)`` (what ``source.region`` takes)."""
        return tuple(1 + d for d in self.dims)

    def region(self, sample_shape: Sequence[int], rank: int) -> dict[int, tuple[int, int]]:
        """Spatial rank ``rank``'s region of a sample, as ``{sample axis: (lo, hi)}``."""
        if len(sample_shape) < 1 + max(self.dims) + 1:
            raise ConfigError(
                f"Layout(dims={self.dims}): a sample of shape {tuple(sample_shape)} has "
                f"{len(sample_shape) - 1} spatial dimension(s); split one it has"
            )
        coords = coords_of(rank, self.grid)
        out = {}
        for axis, parts, c in zip(self.sample_axes, self.grid, coords, strict=True):
            pieces = split_extent(sample_shape[axis], parts)
            lo, hi = pieces[c]
            if any(b <= a for a, b in pieces):
                raise ConfigError(
                    f"Layout(spatial={self.spatial}): dimension {axis - 1} of the sample "
                    f"({sample_shape[axis]} rows) cannot be split {parts} ways; use fewer "
                    "spatial ranks or split another dimension"
                )
            out[axis] = (lo, hi)
        return out

    def describe(self) -> str:
        if self.spatial == 1:
            return "sample parallel (one worker per replica)"
        grid = " x ".join(map(str, self.grid))
        dims = ", ".join(map(str, self.dims))
        return (
            f"spatial={self.spatial}: each sample split {grid} along spatial dim(s) {dims}; "
            f"{self.spatial} workers per replica"
        )


@dataclass(frozen=True)
class ReplicaGroups:
    """``groups[r]``: the workers of replica ``r``; the first of each is its leader."""

    groups: tuple[tuple[str, ...], ...] = field(default=())

    @classmethod
    def sample_parallel(cls, workers: Iterable[str]) -> ReplicaGroups:
        """One replica per worker, in order."""
        return cls(tuple((w,) for w in workers))

    @classmethod
    def of(cls, workers: Iterable[str], size: int = 1) -> ReplicaGroups:
        """Consecutive groups of ``size`` workers; a remainder forms no group."""
        workers = tuple(workers)
        whole = len(workers) // size * size
        return cls(tuple(workers[i : i + size] for i in range(0, whole, size)))

    @property
    def replicas(self) -> int:
        return len(self.groups)

    # Cached: the driver asks these of every replica each round and per worker when
    # groups form (rebuilding the tuple per membership test was quadratic in workers)
    @functools.cached_property
    def leaders(self) -> tuple[str, ...]:
        return tuple(group[0] for group in self.groups)

    @functools.cached_property
    def workers(self) -> tuple[str, ...]:
        return tuple(w for group in self.groups for w in group)

    @functools.cached_property
    def worker_set(self) -> frozenset[str]:
        """``workers`` as a set, for membership tests."""
        return frozenset(self.workers)

    def lost_replicas(self, lost: Iterable[str]) -> tuple[int, ...]:
        """The replicas with a worker in ``lost`` (one lost worker loses its group)."""
        gone = set(lost)
        return tuple(r for r, group in enumerate(self.groups) if gone.intersection(group))

    def without(self, replicas: Iterable[int]) -> ReplicaGroups:
        drop = set(replicas)
        return ReplicaGroups(tuple(g for r, g in enumerate(self.groups) if r not in drop))

    def plus(self, other: ReplicaGroups) -> ReplicaGroups:
        return ReplicaGroups(self.groups + other.groups)


def whole_replicas(max_workers: int, size: int) -> int:
    """How many replicas of ``size`` workers ``max_workers`` holds (at least one: the
    config refuses fewer workers than one replica needs). ``max_workers`` counts
    workers, whatever the layout."""
    return max(1, max_workers // size)


def starting_workers(
    available: Sequence[str], replicas: int | None, size: int = 1, most: int | None = None
) -> list[str]:
    """A fit's first workers: ``replicas`` groups of ``size`` (None: every worker, but no
    more than ``most`` workers, ``max_workers``, in whole groups; the driver forms as
    many groups as fit, a remainder waits in its pool as spares, as do the workers left
    out, which replace lost ones). The count is fixed before the driver's machine
    exists: the replica specification and the cost plan are built for it."""
    if not available:
        raise ConfigError("the client has no workers; start some before fit()")
    if len(available) < size:
        raise ConfigError(
            f"Layout(spatial={size}) splits each sample over {size} workers but the client "
            f"has {len(available)}; start more workers or use a smaller spatial"
        )
    wanted = replicas * size if replicas else len(available)
    if not replicas and most is not None:
        wanted = min(wanted, whole_replicas(most, size) * size)
    if wanted > len(available):
        each = f" of {size} workers each need {wanted}" if size > 1 else ""
        raise ConfigError(
            f"replicas={replicas}{each} but the client has {len(available)} worker(s); "
            "start more workers or lower replicas"
        )
    return list(available[:wanted])


def fewer_workers_hint(spatial: int, workers: int, replicas: int = 1) -> str:
    """What to say when ``workers`` are left for a fit that needs ``replicas`` groups of
    ``spatial`` workers: how many to restart with, or the layout they could run."""
    need = spatial * max(1, replicas)
    text = f"{workers} worker(s) left; spatial={spatial} needs {spatial} per replica"
    if replicas > 1:
        text += f" and min_workers={replicas} replicas"
    text += f": restart with >= {need} workers"
    fits = min(workers // max(1, replicas), spatial - 1)
    if workers < need and fits >= 1:
        text += f", or resume with layout=dfl.Layout(spatial={fits})"
    return text
