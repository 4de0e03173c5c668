"""The layout model: sample, spatial or hybrid, with the least predicted step time that
fits the memory budget (issue 16; Dryden et al. 2019).

A layout arranges ``W`` workers as ``G`` sample groups × ``P`` spatial ranks: each
group trains ``ceil(B / G)`` samples of the global batch, each sample's spatial dims
split over its ``P`` ranks (``dims``, as a ``grid``). Per step, on the slowest rank:

    t = compute + halo_exposed + gather + reductions + allreduce_exposed + fixed

- compute: each layer's fit ``a × calls + c × local voxels × local batch``
  (:class:`LayerFit`, measured per layer and local size);
- halo: the rows :mod:`dataflow.spatial.geometry` says each windowed layer exchanges,
  ``α + n/β`` per message (forward and the adjoint in backward); the forward's first
  split dim travels while the interior computes, the rest is exposed;
- gather: an allreduce of the zero-filled whole tensor over ``P`` (and its adjoint);
- reductions: BatchNorm's statistics and global average pooling, small allreduces;
- allreduce: the gradients over all ``W`` workers, bucket by bucket behind backward
  (:func:`~dataflow.costmodel.collective.exposed_allreduce_seconds`).

Memory per worker: parameters, gradients, buckets and optimizer state, plus what
autograd keeps for backward on the rank (its region of every layer's output, the
halo'd inputs, the gathered tensors), at the local batch. Pure: no torch, no Dask.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.costmodel.collective import (
    Link,
    Topology,
    allreduce_seconds,
    bucket_sizes,
    exposed_allreduce_seconds,
)
from dataflow.costmodel.layout_candidates import LayoutCandidate, candidates, splits_of
from dataflow.costmodel.layout_prediction import LayoutPrediction, format_table
from dataflow.costmodel.layout_ranks import (
    KINDS,
    WHOLE_AFTER,
    LayerFit,
    LayerShape,
    RankCost,
    SavedCopies,
    rank_cost,
    representative_coords,
)

MIB = 1 << 20
FIRST_BUCKET_BYTES = MIB  # as stages/buckets.py and DDP
MAX_SPATIAL = 4096  # how far the "smallest P that fits" search looks
GIVEN = "layer fits given to LayoutModel(fits=...), no calibration recorded"


@dataclass(frozen=True, kw_only=True)
class LayoutModel:
    """A model's layers and their measured costs on one kind of worker (see the module
    docstring). ``fits``: a :class:`LayerFit` per layer name (gathers need none);
    ``region_fits``: for layers whose partitioned form runs other code (BatchNorm's
    statistics over the group), its fit on a region;
    ``topology``: the collectives' links (the group's allreduces, the gradients');
    ``halo_link``: the point-to-point link between a group's ranks (default: the
    topology's inside a node); ``optimizer_states``: weight-sized optimizer tensors (1:
    SGD with momentum, 2: Adam); ``fixed_s``: per step whatever the layout (loss,
    update); ``shared``: ``(ranks computing at once on a node, slowdown)`` pairs, as
    ``ComputeFit.shared`` (a node's ranks share its caches and memory bandwidth; none:
    1); ``saved``: what the layers keep for backward; ``jitter``: the relative spread
    (a standard deviation over the median) of one layer's time from call to call. A
    group waits for its slowest rank at every layer that exchanges a halo or reduces,
    and the groups wait for the slowest group at the gradients' allreduce: the expected
    maximum of ``P`` draws is ``c_P`` standard deviations above the mean (``c_2 =
    0.56``, ``c_4 = 1.03``), see :func:`expected_max_excess`; ``sync_overhead_s``:
    per step with more than one worker, what the engine measured a synchronous step to
    cost beyond compute and the α-β allreduce (``CostModel.sync_overhead_s`` from
    :func:`dataflow.costmodel.calibrate`: the wait for the slowest replica, the
    gradient hooks' copies, the collective's wait loop). Given, it replaces the
    statistical wait across groups. ``basis``: what the fits rest on (the calibration
    that measured them, when, where; :func:`dataflow.spatial.profile.calibrate_layout`
    writes it), named in every prediction: predictions are a pure function of the
    model, so the same model and inputs always predict the same."""

    layers: tuple[LayerShape, ...]
    fits: Mapping[str, LayerFit]
    topology: Topology
    region_fits: Mapping[str, LayerFit] = field(default_factory=dict)
    halo_link: Link | None = None
    bytes_per_element: int = 4
    optimizer_states: int = 1
    backward_fraction: float = 2 / 3
    bucket_bytes: int = 25 * MIB
    overlap: float = 1.0
    fixed_s: float = 0.0
    shared: tuple[tuple[int, float], ...] = ()
    max_micro_batch: int | None = None
    saved: SavedCopies = field(default_factory=SavedCopies)
    jitter: float = 0.0
    sync_overhead_s: float = 0.0
    name: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    basis: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or not all(isinstance(x, LayerShape) for x in self.layers):
            raise ConfigError("LayoutModel(layers=...): give the model's LayerShapes, in order")
        names = [x.name for x in self.layers]
        if len(set(names)) != len(names):
            raise ConfigError(f"LayoutModel(layers=...): layer names repeat in {names}")
        missing = [x.name for x in self.layers if x.kind != "gather" and x.name not in self.fits]
        if missing:
            raise ConfigError(
                f"LayoutModel(fits=...): no LayerFit for {missing}; measure them with "
                "dataflow.spatial.profile.measure_layers or give LayerFit(fixed_s=, per_voxel_s=)"
            )
        for name in ("bytes_per_element", "optimizer_states", "bucket_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"LayoutModel({name}={value!r}): an int >= 0")
        for name in ("backward_fraction", "overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"LayoutModel({name}={getattr(self, name)}): in [0, 1]")
        for count, factor in self.shared:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1 or factor <= 0:
                raise ConfigError(
                    f"LayoutModel(shared={self.shared!r}): (ranks busy on a node, slowdown) "
                    "pairs, ints >= 1 and factors > 0"
                )
        object.__setattr__(
            self, "shared", tuple(sorted((int(k), float(f)) for k, f in self.shared))
        )
        if not (math.isfinite(self.sync_overhead_s) and self.sync_overhead_s >= 0):
            raise ConfigError(f"LayoutModel(sync_overhead_s={self.sync_overhead_s}): >= 0")
        if not (math.isfinite(self.jitter) and self.jitter >= 0):
            raise ConfigError(f"LayoutModel(jitter={self.jitter}): a relative spread >= 0")
        if not self.fixed_s >= 0:
            raise ConfigError(f"LayoutModel(fixed_s={self.fixed_s}): seconds >= 0")
        if self.max_micro_batch is not None and self.max_micro_batch < 1:
            raise ConfigError(f"LayoutModel(max_micro_batch={self.max_micro_batch}): >= 1 or None")

    def replace(self, **changes: Any) -> LayoutModel:
        return dataclasses.replace(self, **changes)

    @property
    def spatial_dims(self) -> int:
        return len(self.layers[0].in_shape) - 1

    @property
    def parameter_bytes(self) -> int:
        return sum(x.params for x in self.layers) * self.bytes_per_element

    def candidates(self, workers: int, *, global_batch: int | None = None) -> list[LayoutCandidate]:
        return candidates(workers, self.layers, global_batch=global_batch)

    # -- predictions ---------------------------------------------------------------------

    def _link(self, spatial: int) -> Link:
        if self.halo_link is not None:
            return self.halo_link
        if self.topology.nodes(spatial) > 1:
            return self.topology._inter(spatial)
        return self.topology.intra

    def _ranks(self, candidate: LayoutCandidate, batch: int) -> list[RankCost]:
        if candidate.dims and max(candidate.dims) >= self.spatial_dims:
            raise ConfigError(
                f"{candidate.describe()}: the model's samples have {self.spatial_dims} "
                "spatial dims (0-based dims)"
            )
        link = self._link(candidate.spatial)
        return [
            rank_cost(self, candidate.dims, candidate.grid, coords, batch, link)
            for coords in representative_coords(candidate.grid)
        ]

    def memory_bytes(self, candidate: LayoutCandidate, *, local_batch: int) -> dict[str, int]:
        """Bytes one worker holds at ``local_batch`` samples per group (the fullest
        rank), with the ``total``."""
        saved = max(r.saved_bytes for r in self._ranks(candidate, local_batch))
        return self._memory(saved)

    def _memory(self, activations: int) -> dict[str, int]:
        p = self.parameter_bytes
        parts = {
            "weights": p,
            "gradients": p,
            "buckets": p,
            "optimizer": self.optimizer_states * p,
            "activations": activations,
        }
        parts["total"] = sum(parts.values())
        return parts

    def predict(
        self, candidate: LayoutCandidate, *, global_batch: int, micro_batch: int | None = None
    ) -> LayoutPrediction:
        """The step of ``global_batch`` samples under ``candidate``, on its slowest rank,
        in micro-batches of at most ``micro_batch`` samples per group (default: the
        model's ``max_micro_batch``, else the whole local batch at once)."""
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ConfigError(f"predict(global_batch={global_batch!r}): an int >= 1")
        local = math.ceil(global_batch / candidate.groups)
        micro = min(local, micro_batch or self.max_micro_batch or local)
        count = math.ceil(local / micro)
        ranks = self._ranks(candidate, micro)
        # the slowest rank: compute plus the halo time it cannot hide
        factor = self.slowdown(self.topology.local(candidate.workers))
        compute, halo, exposed, rank = max(
            (self._halo(r, factor) for r in ranks), key=lambda t: t[0] + t[2]
        )
        gather, reduce = self._group_collectives(candidate, micro)
        backward_s = self.backward_fraction * compute
        buckets = bucket_sizes(self.parameter_bytes, self.bucket_bytes, FIRST_BUCKET_BYTES)
        total, exposed_ar = exposed_allreduce_seconds(
            buckets, candidate.workers, self.topology, backward_s, self.overlap
        )
        memory = self._memory(max(r.saved_bytes for r in ranks))
        within, across = self._sync_seconds(candidate, compute)
        if self.sync_overhead_s and candidate.workers > 1:
            sync = within * count + self.sync_overhead_s
        else:
            sync = (within + across) * count
        return LayoutPrediction(
            candidate=candidate,
            global_batch=global_batch,
            local_batch=local,
            micro_batches=count,
            compute_s=compute * count,
            halo_s=halo * count,
            halo_exposed_s=exposed * count,
            gather_s=gather * count,
            reduce_s=reduce * count,
            allreduce_s=total,
            allreduce_exposed_s=exposed_ar,
            fixed_s=self.fixed_s,
            sync_s=sync,
            halo_bytes=rank.halo_bytes * count,
            memory=memory,
            basis=self.basis or GIVEN,
        )

    def slowdown(self, busy: int) -> float:
        """How much slower a rank computes while ``busy`` ranks compute on its node
        (``shared``, linear between measured counts; 1 alone)."""
        points = [(1, 1.0), *((k, f) for k, f in self.shared if k > 1)]
        if busy <= 1 or len(points) == 1:
            return 1.0
        for (k0, f0), (k1, f1) in itertools.pairwise(points):
            if busy <= k1:
                return f0 + (f1 - f0) * (busy - k0) / (k1 - k0)
        return points[-1][1]

    def _halo(self, r: RankCost, factor: float = 1.0) -> tuple[float, float, float, RankCost]:
        """(compute, halo, exposed halo, r) seconds of rank ``r``: the forward's first
        split dim travels while the interior computes; the other dims and the backward's
        adjoint exchange wait."""
        fwd = 1.0 - self.backward_fraction
        halo = exposed = 0.0
        for seconds, dims, interior in zip(r.compute_s, r.halo_s, r.interior, strict=True):
            if dims:
                halo += 2 * sum(dims)
                hidden = fwd * seconds * factor * interior
                exposed += max(0.0, dims[0] - hidden) + sum(dims[1:]) + sum(dims)
        return sum(r.compute_s) * factor, halo, exposed, r

    def _sync_seconds(self, candidate: LayoutCandidate, compute_s: float) -> tuple[float, float]:
        """The expected wait for the slowest rank in one micro-batch: (inside a group at
        every timed layer: each layer's noise is ``jitter`` of its time, the waits add
        up to ``c_P × jitter × compute``; across the groups once, at the gradients'
        allreduce: the step's noise, ``jitter × compute / sqrt(layers)``)."""
        if not self.jitter or compute_s <= 0:
            return 0.0, 0.0
        timed = max(1, sum(1 for x in self.layers if x.kind != "gather"))
        within = expected_max_excess(candidate.spatial) * self.jitter * compute_s
        across = expected_max_excess(candidate.groups) * self.jitter * compute_s / timed**0.5
        return within, across

    def _group_collectives(self, candidate: LayoutCandidate, batch: int) -> tuple[float, float]:
        """(gather, reductions) seconds of one forward + backward on a group of ``P``."""
        p = candidate.spatial
        if p == 1:
            return 0.0, 0.0
        topo, bpe = self.topology, self.bytes_per_element
        gather = reduce = 0.0
        # every forward first agrees on the global shape: P x dims float64
        reduce += allreduce_seconds(8 * p * len(candidate.dims), p, topo)
        for layer in self.layers:
            if layer.kind == "gather":
                whole = math.prod(layer.out_shape) * batch * bpe
                gather += 2 * allreduce_seconds(whole, p, topo)
            elif layer.kind == "norm":  # forward: every rank's moments; backward: 2 sums
                channels = layer.in_shape[0]
                reduce += allreduce_seconds(p * (1 + 2 * channels) * bpe, p, topo)
                reduce += allreduce_seconds(2 * channels * bpe, p, topo)
            elif layer.kind == "reduce":
                reduce += 2 * allreduce_seconds(layer.out_shape[0] * batch * bpe, p, topo)
            if layer.kind in WHOLE_AFTER:
                break
        return gather, reduce

    # -- decisions -----------------------------------------------------------------------

    def choose(
        self,
        candidates: Iterable[LayoutCandidate],
        *,
        global_batch: int,
        budget_bytes: int | None = None,
    ) -> list[LayoutPrediction]:
        """``candidates`` predicted and ranked: those under ``budget_bytes`` first, each
        part by step time (ties: fewer spatial ranks); the first is the choice. A layout
        whose local batch is over the budget trains it in the largest micro-batches that
        fit (gradient accumulation, as the balancer does); one where a single sample is
        over is marked ``fits=False``. None fits: a :class:`ConfigError` naming the
        smallest spatial group one sample fits in, or saying that none does."""
        preds = [self._under(c, global_batch, budget_bytes) for c in candidates]
        if not preds:
            raise ConfigError("choose(candidates=[]): give the layouts to choose from")

        def key(p: LayoutPrediction) -> tuple[bool, float, int, tuple[int, ...]]:
            return (p.fits is False, p.step_s, p.candidate.spatial, p.candidate.dims)

        preds.sort(key=key)
        if budget_bytes is not None and not preds[0].fits:
            raise ConfigError(self._refusal(preds, budget_bytes, global_batch))
        return preds

    def _under(
        self, candidate: LayoutCandidate, global_batch: int, budget: int | None
    ) -> LayoutPrediction:
        pred = self.predict(candidate, global_batch=global_batch)
        if budget is None:
            return pred
        if pred.memory_bytes <= budget:
            return dataclasses.replace(pred, fits=True)
        one = self.memory_bytes(candidate, local_batch=1)  # activations grow as the batch
        per_sample = one["activations"]
        room = budget - (one["total"] - per_sample)
        micro = room // per_sample if per_sample else 0
        fitted = self.predict(candidate, global_batch=global_batch, micro_batch=max(1, micro))
        return dataclasses.replace(fitted, fits=micro >= 1)

    def smallest_spatial(
        self, budget_bytes: int, *, local_batch: int = 1, max_spatial: int = MAX_SPATIAL
    ) -> LayoutCandidate | None:
        """The spatial group with the fewest ranks whose memory per worker at
        ``local_batch`` fits ``budget_bytes`` (single dims, then pairs of dims), or None.
        Memory falls as ``P`` grows: the first power of two that fits brackets the
        answer, a bisection below it finds it."""
        extents = sorted(self.layers[0].in_shape[1:], reverse=True)
        top = min(max_spatial, extents[0] * (extents[1] if len(extents) > 1 else 1))

        def fitting(p: int) -> LayoutCandidate | None:
            for c in splits_of(1, p, self.layers[0].in_shape[1:]):
                if self.memory_bytes(c, local_batch=local_batch)["total"] <= budget_bytes:
                    return c
            return None

        low, high = 0, 1  # nothing fits at low (0: none tried), something may at high
        while high < top and fitting(high) is None:
            low, high = high, min(top, 2 * high)
        if fitting(high) is None:
            return None
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if fitting(mid) is not None else (mid, high)
        return fitting(high)

    def _refusal(self, preds: Sequence[LayoutPrediction], budget: int, batch: int) -> str:
        least = min(preds, key=lambda p: p.memory_bytes)
        workers = preds[0].candidate.workers
        head = (
            f"no layout of {workers} worker(s) fits memory_per_worker={_gib(budget)} at "
            f"global batch {batch}: the least is {_gib(least.memory_bytes)} "
            f"({least.candidate.describe()}, {least.local_batch} sample(s) per group in "
            f"micro-batches of {math.ceil(least.local_batch / least.micro_batches)})"
        )
        smallest = self.smallest_spatial(budget)
        if smallest is None:
            p = self._memory(0)["total"]
            return (
                f"{head}; no spatial split of up to {MAX_SPATIAL} ranks fits one sample "
                f"(parameters, gradients and optimizer state alone: {_gib(p)}): raise "
                "memory_per_worker or use a smaller model"
            )
        return (
            f"{head}; one sample fits from spatial={smallest.spatial} "
            f"({smallest.describe()}): use a multiple of {smallest.spatial} workers "
            "(layout='auto' or spatial=...), more workers for fewer samples per group, "
            "or raise memory_per_worker"
        )


def expected_max_excess(draws: int) -> float:
    """How many standard deviations the largest of ``draws`` normal draws lies above
    their mean, in expectation (Blom's approximation, within 3 % of the tabulated values
    from 3 draws on; exact for one and two)."""
    if draws <= 1:
        return 0.0
    if draws == 2:
        return 1 / math.sqrt(math.pi)  # exact
    return statistics.NormalDist().inv_cdf((draws - 0.375) / (draws + 0.25))


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.3g} GiB" if nbytes >= 1 << 28 else f"{nbytes / MIB:.3g} MiB"


__all__ = [
    "KINDS",
    "LayerFit",
    "LayerShape",
    "LayoutCandidate",
    "LayoutModel",
    "LayoutPrediction",
    "SavedCopies",
    "candidates",
    "expected_max_excess",
    "format_table",
]
