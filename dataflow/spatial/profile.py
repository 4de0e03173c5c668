"""Measure what the layout model (:mod:`dataflow.costmodel.layout_cost`) needs of a model:
its layers' shapes, each layer's compute at the local sizes the layouts give it, and
the bytes autograd keeps for backward.

``layer_shapes`` (:mod:`dataflow.spatial.shapes`) traces the model with ``torch.fx``
and propagates meta tensors, as ``SpatialModule`` plans it, and says where its
gathers go. ``measure_layers`` times
each layer's forward + backward alone, in this process, on the local input it would
see under each spatial split (its region, with the halo for convolution and pooling),
and fits ``a × calls + c × voxels × batch`` per layer. ``calibrate_layout`` puts it
together with a link into a :class:`~dataflow.costmodel.layout_cost.LayoutModel`.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from dataflow.core.errors import ConfigError, ModelError
from dataflow.costmodel.collective import Link, Topology
from dataflow.costmodel.compute import fit_line
from dataflow.costmodel.layout_cost import LayerFit, LayerShape, LayoutCandidate, LayoutModel
from dataflow.costmodel.layout_ranks import REGION_KINDS, WHOLE_AFTER, work_voxels
from dataflow.spatial.comm import SpatialGroup
from dataflow.spatial.geometry import clip, split_extent
from dataflow.spatial.layers import SpatialBatchNorm
from dataflow.spatial.shapes import layer_shapes

# -- saved bytes -------------------------------------------------------------------------


class SavedBytes:
    """Counts the bytes autograd keeps for backward, each storage once, leaving out the
    module's parameters and buffers (the layout model counts them apart) and meta
    tensors (``SpatialModule`` plans its first forward on them)."""

    def __init__(self, module: nn.Module | None = None) -> None:
        tensors = [] if module is None else [*module.parameters(), *module.buffers()]
        self.skip = {t.untyped_storage().data_ptr() for t in tensors}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.skip:
                self.storages[ptr] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def saved_activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """The bytes autograd keeps for backward after ``module(x)`` on this rank (each
    storage once; parameters and buffers left out). Run it on every rank of a group at
    once when ``module`` is a ``SpatialModule``: its forward communicates."""
    counter = SavedBytes(module)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = module(x)
    del out
    return counter.total


# -- compute -----------------------------------------------------------------------------


@dataclass
class LayerTimings:
    """What :func:`measure_layers` found: a fit per layer (``fits``; ``region_fits``
    for layers whose partitioned form runs other code), backward's share of the
    layers' time, and every timed point (layer, spatial, batch, input shape, voxels,
    calls, seconds, forward seconds)."""

    fits: dict[str, LayerFit] = field(default_factory=dict)
    region_fits: dict[str, LayerFit] = field(default_factory=dict)
    backward_fraction: float = 2 / 3
    points: list[dict[str, Any]] = field(default_factory=list)
    jitter: float = 0.0  # relative spread of a layer's time between calls, time-weighted


def measure_layers(
    module: nn.Module,
    sample_shape: Sequence[int],
    *,
    spatial: Sequence[int] = (1, 2, 4),
    dim: int = 0,
    batch: int = 1,
    repeats: int = 5,
    warmup: int = 1,
    layers: Sequence[LayerShape] | None = None,
) -> LayerTimings:
    """Time each layer's forward + backward alone, in this process (with its torch
    threads), on the local input it would see with each of ``spatial`` ranks splitting
    spatial dim ``dim`` (the largest rank's region, plus the halo for convolution and
    pooling), at local ``batch``: the median of ``repeats`` runs after ``warmup``, the
    sizes taking turns. Each layer's :class:`LayerFit` keeps the points (by the
    voxels of the region it computes) and the line ``a + c × voxels × batch`` through
    them."""
    for name, value in (("batch", batch), ("repeats", repeats), ("warmup", warmup + 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"measure_layers({name}={value!r}): an int >= 1")
    if not spatial or any(not isinstance(p, int) or p < 1 for p in spatial):
        raise ConfigError(f"measure_layers(spatial={spatial!r}): rank counts, ints >= 1")
    layers = list(layers) if layers is not None else layer_shapes(module, sample_shape)
    if not 0 <= dim < len(layers[0].in_shape) - 1:
        raise ConfigError(f"measure_layers(dim={dim}): a spatial dim of {tuple(sample_shape)}")
    traced = torch.fx.symbolic_trace(copy.deepcopy(module))
    nodes = {n.target if n.op == "call_module" else n.name: n for n in traced.graph.nodes}
    ops = {n.name: n for n in traced.graph.nodes}
    found = LayerTimings()
    forward_s = total_s = spread_s = 0.0
    region = True
    for index, layer in enumerate(layers):
        on_region = region and layer.kind in REGION_KINDS
        region = region and layer.kind not in WHOLE_AFTER
        if layer.kind == "gather":
            continue
        node = nodes.get(layer.name) or ops.get(layer.name)
        sizes = sorted(set(spatial)) if on_region else [1]
        plain: list[tuple[int, float]] = []
        split: list[tuple[int, float]] = []
        runs = []
        for p in sizes:
            op = _op(traced, node, layer, partitioned=p > 1)
            shape, voxels = _local_input(layer, p, dim) if on_region else _whole(layer)
            runs.append((p, op, shape, voxels))
        timed = _time(
            [(op, (batch, *shape)) for _, op, shape, _ in runs], index > 0, repeats, warmup
        )
        for (p, _, shape, voxels), (fwd, both, _, spread) in zip(runs, timed, strict=True):
            (split if p > 1 and layer.kind == "norm" else plain).append((voxels * batch, both))
            if p == 1:
                forward_s, total_s = forward_s + fwd, total_s + both
                spread_s += spread * both
            found.points.append(
                dict(layer=layer.name, spatial=p, batch=batch, input=list(shape), voxels=voxels,
                     seconds=both, forward_s=fwd)
            )  # fmt: skip
        found.fits[layer.name] = _fit(plain)
        if split:
            found.region_fits[layer.name] = _fit(split)
    if total_s > 0:
        found.backward_fraction = min(1.0, max(0.0, 1.0 - forward_s / total_s))
        found.jitter = spread_s / total_s
    return found


def _local_input(layer: LayerShape, parts: int, dim: int) -> tuple[tuple[int, ...], int]:
    """The largest local input of ``layer`` with ``parts`` ranks along spatial ``dim``
    (the region, plus its halo for a windowed layer), and the voxels the layout model
    counts for it (those of the region it computes)."""
    shape, out = list(layer.in_shape), list(layer.out_shape)
    n_in = shape[1 + dim]
    owned = split_extent(n_in, parts)
    rows = list(owned)
    if layer.kind in ("conv", "pool"):
        window = layer.windows[dim]
        outs = split_extent(out[1 + dim], parts)
        needs = [clip(window.needed(o), n_in) for o in outs]
        rows = [(lo, hi) if hi > lo else own for (lo, hi), own in zip(needs, owned, strict=True)]
        out[1 + dim] = max(hi - lo for lo, hi in outs)
    elif layer.kind not in WHOLE_AFTER:
        out[1 + dim] = max(hi - lo for lo, hi in owned)
    region_in = [*shape[1:]]
    region_in[dim] = max(hi - lo for lo, hi in owned)
    shape[1 + dim] = max(hi - lo for lo, hi in rows)
    return tuple(shape), work_voxels(layer.kind, region_in, out[1:])


def _whole(layer: LayerShape) -> tuple[tuple[int, ...], int]:
    return layer.in_shape, work_voxels(layer.kind, layer.in_shape[1:], layer.out_shape[1:])


def _op(
    traced: torch.fx.GraphModule, node: Any, layer: LayerShape, *, partitioned: bool
) -> Callable[[torch.Tensor], Any]:
    """The layer as a function of its one tensor input: the traced module (a copy), or
    the traced function with its other arguments, or BatchNorm's partitioned form."""
    if node is None:
        raise ModelError(f"measure_layers: no node {layer.name!r} in the traced model")
    if node.op == "call_module":
        m = copy.deepcopy(traced.get_submodule(node.target)).train()
        if partitioned and isinstance(m, nn.modules.batchnorm._BatchNorm):
            bn = SpatialBatchNorm(m)
            bn.group = SpatialGroup(None, rank=0, size=1, grid=(1,))  # its code, no peers
            return bn
        return m
    first = node.all_input_nodes[0]

    def call(x: torch.Tensor) -> Any:
        args = [x if a is first else a for a in node.args]
        if node.op == "call_method":
            return getattr(x, node.target)(*args[1:], **node.kwargs)
        return node.target(*args, **node.kwargs)

    return call


def _time(
    runs: Sequence[tuple[Callable[[torch.Tensor], Any], tuple[int, ...]]],
    grad_in: bool,
    repeats: int,
    warmup: int,
) -> list[tuple[float, float, tuple[int, ...]]]:
    """(forward, forward + backward seconds, output shape, relative spread of the
    latter) of each ``(op, input shape)``
    (the input needing a gradient unless it is the model's), the median of ``repeats``
    after ``warmup``; the runs take turns, so a burst of other work slows them alike."""
    setups = []
    for op, shape in runs:
        x = torch.randn(shape, requires_grad=grad_in)
        params = list(op.parameters()) if isinstance(op, nn.Module) else []
        if not grad_in and not params:
            x.requires_grad_(True)  # something must need a gradient for backward to run
        out = op(x)
        setups.append((op, x, params, torch.randn_like(out), tuple(out.shape), [], []))
    for i in range(warmup + repeats):
        for op, x, params, grad, _, fwd, both in setups:
            for p in params:
                p.grad = None
            x.grad = None
            start = time.perf_counter()
            out = op(x)
            mid = time.perf_counter()
            out.backward(grad)
            end = time.perf_counter()
            if i >= warmup:
                fwd.append(mid - start)
                both.append(end - start)
    return [
        (statistics.median(f), statistics.median(b), shape, _relative_spread(b))
        for *_, shape, f, b in setups
    ]


def _relative_spread(seconds: list[float]) -> float:
    """A standard deviation over the median, robust to one outlier: 1.4826 × the
    median absolute deviation (a normal's standard deviation) over the median."""
    middle = statistics.median(seconds)
    if middle <= 0 or len(seconds) < 3:
        return 0.0
    return 1.4826 * statistics.median(abs(t - middle) for t in seconds) / middle


def _fit(points: list[tuple[int, float]]) -> LayerFit:
    """The measured points and the line ``seconds = a + c × (voxels × batch)`` through
    them, never negative: through the origin when the intercept would be, flat when the
    slope would be."""
    merged: dict[int, float] = {}
    for x, y in points:  # two sizes may give a layer the same region
        merged[x] = min(y, merged.get(x, y))
    pts = tuple(sorted(merged.items()))
    if len(pts) < 2:
        x, y = pts[0]
        return LayerFit(fixed_s=0.0, per_voxel_s=y / x if x else 0.0, points=pts)
    a, c = fit_line(pts)
    if c < 0:
        return LayerFit(fixed_s=statistics.mean(y for _, y in pts), per_voxel_s=0.0, points=pts)
    if a < 0:
        c = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
        return LayerFit(fixed_s=0.0, per_voxel_s=c, points=pts)
    return LayerFit(fixed_s=a, per_voxel_s=c, points=pts)


def calibrate_layout(
    module: nn.Module,
    sample_shape: Sequence[int],
    *,
    link: Link | Topology,
    spatial: Sequence[int] = (1, 2, 4),
    dim: int = 0,
    batch: int = 1,
    repeats: int = 5,
    optimizer_states: int = 1,
    whole_model: bool = True,
    name: str = "",
) -> LayoutModel:
    """A :class:`LayoutModel` of ``module`` on this process's kind of worker: its layers
    (:func:`layer_shapes`), their compute (:func:`measure_layers`), ``link`` for the
    group's and the gradients' collectives (a :class:`Link` inside one node, or a
    :class:`Topology`), and the optimizer's step as the layout-independent cost.

    ``whole_model``: also time the whole model's forward + backward at ``batch`` and
    scale every layer's fit by it over the layers' sum (layers timed alone miss what
    they cost together: fresh allocations for the activations a step keeps, colder
    caches; about 1.2 on this repository's CPU for a 3D CNN)."""
    layers = layer_shapes(module, sample_shape)
    timings = measure_layers(
        module, sample_shape, spatial=spatial, dim=dim, batch=batch, repeats=repeats, layers=layers
    )
    topology = link if isinstance(link, Topology) else Topology(intra=link)
    model = LayoutModel(
        layers=tuple(layers),
        fits=timings.fits,
        region_fits=timings.region_fits,
        topology=topology,
        backward_fraction=timings.backward_fraction,
        jitter=timings.jitter,
        optimizer_states=optimizer_states,
        fixed_s=_optimizer_seconds(module, repeats),
        name=name or type(module).__name__,
    )
    scale, scale_note = 1.0, "not measured"
    if whole_model:
        summed = model.predict(LayoutCandidate(groups=1), global_batch=batch).compute_s
        ratio = _whole_seconds(module, (batch, *sample_shape), repeats) / summed if summed else 1.0
        scale, scale_note = plausible_scale(ratio)
    jitter, jitter_note = plausible_jitter(timings.jitter)
    notes = {
        "compute": f"each layer alone, forward + backward, at spatial {list(spatial)} along "
        f"dim {dim}, local batch {batch}: median of {repeats}; "
        f"{torch.get_num_threads()} torch thread(s); scaled by {scale:.3f}, the whole "
        f"model's forward + backward over the sum of its layers alone ({scale_note})",
        "topology": f"given: {topology.intra.name or 'link'} {topology.intra.source}".strip(),
        "fixed_s": "one SGD-with-momentum step of the parameters",
        "jitter": f"{jitter:.3f}: each layer's spread between its {repeats} calls "
        f"(1.4826 MAD over the median), weighted by its time ({jitter_note})",
    }
    model = model.replace(
        fits={k: _scaled(f, scale) for k, f in timings.fits.items()},
        region_fits={k: _scaled(f, scale) for k, f in timings.region_fits.items()},
        jitter=jitter,
        notes=notes,
    )
    return model.replace(basis=_basis(model, sample_shape, batch, scale))


SCALE_RANGE = (1 / 3, 3.0)  # the whole model over its layers alone: ~1.2 measured here
JITTER_CAP = 0.5  # a layer's relative spread beyond this is a disturbed measurement


def plausible_scale(ratio: float) -> tuple[float, str]:
    """(the scale applied, why): the whole model's step over its layers' sum, unless it
    is outside ``SCALE_RANGE`` (a disturbed timing of one or the other): then 1."""
    low, high = SCALE_RANGE
    if low <= ratio <= high:
        return ratio, "measured"
    return 1.0, (
        f"measured {ratio:.3g}, outside [{low:.2f}, {high:g}]: implausible, discarded, "
        "the layers' own times are used"
    )


def plausible_jitter(jitter: float) -> tuple[float, str]:
    """(the spread applied, why): capped at ``JITTER_CAP`` (beyond it the timings were
    mostly disturbance, and the waits they predict are not the engine's)."""
    if jitter <= JITTER_CAP:
        return jitter, "measured"
    return JITTER_CAP, f"measured {jitter:.3g}, capped at {JITTER_CAP:g}: a disturbed machine"


def _basis(model: LayoutModel, sample_shape: Sequence[int], batch: int, scale: float) -> str:
    """What every prediction of ``model`` rests on: this calibration, named by a digest
    of what it measured, with where, when and at what."""
    regions = {f"region:{k}": f for k, f in model.region_fits.items()}
    fits = sorted({**model.fits, **regions}.items())
    measured = repr((fits, model.fixed_s, model.jitter, model.backward_fraction))
    digest = hashlib.sha1(measured.encode()).hexdigest()[:10]
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return (
        f"calibrate_layout {digest}: {model.name} at {tuple(sample_shape)}, local batch {batch}, "
        f"measured {when} in process {os.getpid()} ({torch.get_num_threads()} torch "
        f"thread(s)), scale {scale:.3f}, jitter {model.jitter:.3f}"
    )


def _scaled(fit: LayerFit, scale: float) -> LayerFit:
    points = tuple((w, t * scale) for w, t in fit.points)
    return LayerFit(fixed_s=fit.fixed_s * scale, per_voxel_s=fit.per_voxel_s * scale, points=points)


def _whole_seconds(module: nn.Module, shape: tuple[int, ...], repeats: int) -> float:
    """Median forward + backward seconds of (a copy of) the whole model."""
    model = copy.deepcopy(module).train()
    x = torch.randn(shape)
    grad = torch.randn_like(model(x))
    times = []
    for i in range(1 + repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(x).backward(grad)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _optimizer_seconds(module: nn.Module, repeats: int) -> float:
    params = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    opt.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


__all__ = [
    "JITTER_CAP",
    "SCALE_RANGE",
    "LayerTimings",
    "SavedBytes",
    "calibrate_layout",
    "layer_shapes",
    "measure_layers",
    "saved_activation_bytes",
]
