"""The layouts of ``W`` workers the layout model chooses from: ``G`` sample groups ×
``P`` spatial ranks, and which spatial dims the ranks split. Pure."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dataflow.core.errors import ConfigError
from dataflow.costmodel.layout_ranks import LayerShape
from dataflow.spatial.geometry import grid_shape


@dataclass(frozen=True, kw_only=True)
class LayoutCandidate:
    """``groups`` × ``spatial`` workers; ``dims``: the split spatial dims (0 = the first
    spatial dim, after batch and channels), ``grid``: ranks along each (product
    ``spatial``). ``SpatialModule`` takes tensor dims: :attr:`tensor_dims`."""

    groups: int
    spatial: int = 1
    dims: tuple[int, ...] = ()
    grid: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("groups", "spatial"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"LayoutCandidate({name}={value!r}): an int >= 1")
        object.__setattr__(self, "dims", tuple(self.dims))
        object.__setattr__(self, "grid", tuple(self.grid))
        if len(self.dims) != len(self.grid) or len(set(self.dims)) != len(self.dims):
            raise ConfigError(
                f"LayoutCandidate(dims={self.dims}, grid={self.grid}): one grid size per "
                "distinct split dim"
            )
        if math.prod(self.grid) != self.spatial or (self.spatial == 1) != (not self.dims):
            raise ConfigError(
                f"LayoutCandidate(spatial={self.spatial}, grid={self.grid}): the grid's "
                "product must be spatial, and spatial=1 splits no dims"
            )

    @property
    def workers(self) -> int:
        return self.groups * self.spatial

    @property
    def kind(self) -> str:
        if self.spatial == 1:
            return "sample"
        return "spatial" if self.groups == 1 else "hybrid"

    @property
    def tensor_dims(self) -> tuple[int, ...]:
        """The split dims counted with batch and channels (``SpatialModule(dims=...)``)."""
        return tuple(d + 2 for d in self.dims)

    def describe(self) -> str:
        split = ""
        if self.dims:
            grid = "x".join(str(g) for g in self.grid)
            split = f" dims {','.join(str(d) for d in self.dims)} ({grid})"
        return f"{self.kind} {self.groups}x{self.spatial}{split}"


def candidates(
    workers: int,
    layers: Sequence[LayerShape],
    *,
    global_batch: int | None = None,
    max_spatial: int | None = None,
) -> list[LayoutCandidate]:
    """Every layout of ``workers``: ``G × P = W`` for each divisor ``P``, split along
    each single spatial dim, and along each pair of them for ``P >= 4`` (the grid as
    square as it goes, both ways round when it is not square). Splits that leave a rank
    of the first layer without a row are left out, as are more groups than
    ``global_batch`` samples."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"candidates(workers={workers!r}): an int >= 1")
    if not layers:
        raise ConfigError("candidates(layers=[]): give the model's LayerShapes")
    extents = layers[0].in_shape[1:]
    out = []
    for p in range(1, workers + 1):
        g = workers // p
        if workers % p or (max_spatial is not None and p > max_spatial):
            continue
        if global_batch is not None and g > global_batch:
            continue
        out.extend(splits_of(g, p, extents))
    return out


def splits_of(groups: int, p: int, extents: Sequence[int]) -> list[LayoutCandidate]:
    """The ways ``groups`` groups of ``p`` ranks split samples of spatial ``extents``."""
    if p == 1:
        return [LayoutCandidate(groups=groups)]
    found = [
        LayoutCandidate(groups=groups, spatial=p, dims=(d,), grid=(p,))
        for d in range(len(extents))
        if extents[d] >= p
    ]
    if p >= 4 and len(extents) >= 2:
        a, b = grid_shape(p, 2)
        if b > 1:
            for d1, d2 in itertools.combinations(range(len(extents)), 2):
                for dims in {(d1, d2), (d2, d1)} if a != b else {(d1, d2)}:
                    if extents[dims[0]] >= a and extents[dims[1]] >= b:
                        found.append(
                            LayoutCandidate(groups=groups, spatial=p, dims=dims, grid=(a, b))
                        )
    return sorted(found, key=lambda c: c.dims)
