"""A worker's place in a spatial layout: its sample group's process group, its region.

Built by the replica's setup when ``Layout(spatial=P)`` with P > 1: the fit's W workers
form W/P sample groups of P consecutive ranks; each group has its own gloo/NCCL group
(halos, BatchNorm statistics, the gather), the fit's group carries the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.planning.layout import Layout
from dataflow.runtime.collective import Collective
from dataflow.spatial.comm import SpatialGroup
from dataflow.spatial.module import SpatialModule


@dataclass
class SpatialRank:
    """What ``ReplicaContext.spatial`` holds on a worker of a spatial layout."""

    layout: Layout
    rank: int  # within the sample group
    group: SpatialGroup
    collective: Collective | None
    seed: int

    def wrap_model(self, model: Any) -> SpatialModule:
        return SpatialModule(model, self.group, self.layout.tensor_dims, seed=self.seed)

    def region_of(self, source: Any) -> Any:
        if self.group.size == 1:  # the driver's dry run: the whole sample
            return source
        if not hasattr(source, "region"):
            raise ConfigError(
                f"Layout(spatial={self.layout.spatial}): the source {type(source).__name__} "
                "cannot read a region of each sample; use dfl.io.ZarrSource, dfl.io.PatchSource or "
                "dfl.io.ArraySource"
            )
        return source.region(self.layout.region(source.sample_shape, self.rank))

    def rejoin(self, collective: Collective) -> Collective | None:
        """A new process group for the same place (after a recovery regrouped the fit);
        returns the old one, aborted, for the caller to keep alive (see
        :meth:`Collective.abort`: a gloo group's destructor can freeze the worker)."""
        old, self.collective = self.collective, collective
        self.group.process_group = collective._live_group()
        self.group._wait = collective.wait
        if old is not None:
            old.abort()
        return old

    def abort(self) -> None:
        """Leave the sample group: a wait in one of its collectives (a layer's halo
        allreduce, BatchNorm's statistics) fails at once. Its partner's worker died, or
        the fit's group did: without this, the wait ran to the collective timeout."""
        if self.collective is not None:
            self.collective.abort()


def spatial_rank(layout: Layout, rank: int, collective: Collective, seed: int) -> SpatialRank:
    group = SpatialGroup(
        collective._live_group(),
        rank=rank,
        size=layout.spatial,
        grid=layout.grid,
        wait=collective.wait,
    )
    return SpatialRank(layout, rank, group, collective, seed)


def whole_sample(layout: Layout, seed: int) -> SpatialRank:
    """The partitioned model on one process holding whole samples (the driver's dry run:
    every layer is classified, so one that cannot be partitioned fails before the fit)."""
    group = SpatialGroup(None, rank=0, size=1, grid=(1,) * len(layout.dims))
    return SpatialRank(layout, 0, group, None, seed)
