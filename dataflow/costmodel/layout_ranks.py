"""A model's layers as the layout model sees them, and one rank of a spatial group layer
by layer: what it computes, sends and keeps.

The layout model (:mod:`dataflow.costmodel.layout_cost`) asks here, for one rank's grid
coordinates, each layer's local output size, its halo traffic and the bytes autograd
keeps for backward. The rows come from :mod:`dataflow.spatial.geometry`
(``split_extent``, ``Window.needed``, ``exchange``), the same functions the partitioned
layers run, so the predicted halo is the real one row for row. Pure: no torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dataflow.core.errors import ConfigError
from dataflow.spatial.geometry import Interval, Window, clip, exchange, split_extent

if TYPE_CHECKING:
    from dataflow.costmodel.collective import Link
    from dataflow.costmodel.layout_cost import LayoutModel

INDEX_BYTES = 8  # max pooling keeps int64 indices of its outputs
KINDS = ("conv", "pool", "norm", "pointwise", "gather", "reduce", "dense")
REGION_KINDS = ("conv", "pool", "norm", "pointwise", "gather", "reduce")  # run on a region
WHOLE_AFTER = ("gather", "reduce", "dense")  # from here on every rank holds the whole tensor
VARIANTS = ("", "max", "avg", "view", "free")


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One layer of the model, for one sample: ``in_shape``/``out_shape`` are
    ``(channels, *spatial)``; ``windows`` one :class:`~dataflow.spatial.geometry.Window`
    per spatial dimension for "conv" and "pool"; ``params`` its parameter count.

    ``kind``: "conv", "pool", "norm", "pointwise" (elementwise: on a region as on the
    whole), "gather" (where the partitioned model makes the sample whole again, before
    Flatten or Linear), "reduce" (global average pooling: a sum and a small allreduce)
    or "dense" (needs the whole sample). ``variant`` says what it keeps for backward
    where the kind does not: "max" pooling keeps indices, "view" layers alias their
    input (Flatten), "free" ones keep nothing (Identity, an addition). Layers are in
    execution order, each reading the previous one's output (a chain); those before the
    first gather, reduce or dense layer run on each rank's region."""

    name: str
    kind: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    windows: tuple[Window, ...] = ()
    params: int = 0
    variant: str = ""

    def __post_init__(self) -> None:
        where = f"LayerShape(name={self.name!r})"
        if self.kind not in KINDS:
            raise ConfigError(f"{where}: kind={self.kind!r}, use one of {list(KINDS)}")
        if self.variant not in VARIANTS:
            raise ConfigError(f"{where}: variant={self.variant!r}, use one of {list(VARIANTS)}")
        for name in ("in_shape", "out_shape"):
            shape = tuple(getattr(self, name))
            if not shape or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape
            ):
                raise ConfigError(
                    f"{where}: {name}={shape!r}, give (channels, *spatial) as ints >= 0"
                )
            object.__setattr__(self, name, shape)
        spatial = len(self.in_shape) - 1
        windowed = self.kind in ("conv", "pool")
        if windowed and len(self.windows) != spatial:
            raise ConfigError(
                f"{where}: a {self.kind} needs one Window per spatial dim ({spatial}), "
                f"got {len(self.windows)}"
            )
        if not windowed and self.windows:
            raise ConfigError(f"{where}: only conv and pool layers have windows; drop windows=")
        if windowed and len(self.out_shape) != len(self.in_shape):
            raise ConfigError(
                f"{where}: out_shape {self.out_shape} must have the input's {spatial} spatial dims"
            )
        if isinstance(self.params, bool) or not isinstance(self.params, int) or self.params < 0:
            raise ConfigError(f"{where}: params={self.params!r}, an int >= 0")
        object.__setattr__(self, "windows", tuple(self.windows))


@dataclass(frozen=True, kw_only=True)
class LayerFit:
    """One layer's forward + backward seconds on one rank: ``fixed_s`` per call (a
    partitioned windowed layer makes one call per box it computes) plus
    ``per_voxel_s`` per output voxel per sample. ``points``: measured ``(voxels ×
    batch, seconds)`` of one call at the local sizes the layouts give the layer
    (:func:`dataflow.spatial.profile.measure_layers`); between them the time follows
    the measurements (a CPU convolution is not linear in its size: torch picks its
    algorithm by shape), beyond them the line's slope."""

    fixed_s: float
    per_voxel_s: float
    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_voxel_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"LayerFit({name}={value!r}): seconds >= 0")
        points = tuple(sorted((int(w), float(t)) for w, t in self.points))
        if any(w < 1 or not (math.isfinite(t) and t >= 0) for w, t in points):
            raise ConfigError(f"LayerFit(points={self.points!r}): (voxels x batch >= 1, s >= 0)")
        if len({w for w, _ in points}) != len(points):
            raise ConfigError(f"LayerFit(points={self.points!r}): sizes repeat")
        object.__setattr__(self, "points", points)

    def seconds(self, voxels: int, batch: int, calls: int = 1) -> float:
        work = voxels * batch
        if work <= 0:
            return 0.0
        if not self.points:
            return self.fixed_s * calls + self.per_voxel_s * work
        extra, pts, slope = self.fixed_s * (calls - 1), self.points, self.per_voxel_s
        if work <= pts[0][0]:
            w0, t0 = pts[0]
            return extra + max(t0 * work / w0, t0 - slope * (w0 - work))
        for (w0, t0), (w1, t1) in itertools.pairwise(pts):
            if work <= w1:
                return extra + t0 + (t1 - t0) * (work - w0) / (w1 - w0)
        return extra + pts[-1][1] + slope * (work - pts[-1][0])


@dataclass(frozen=True, kw_only=True)
class SavedCopies:
    """How many copies of a tensor the layers keep for backward, where the layers'
    implementation decides it: torch's layers on one rank, ``dataflow.spatial.layers``
    on several. ``norm_region``: copies of its region a partitioned BatchNorm keeps (1:
    its input, as torch's); ``halo_copy``: a partitioned convolution or pooling keeps
    its whole halo'd input (region + halo) for its shells (False: each shell keeps its
    own input, a slab a window span thick, and the interior a view of the region);
    ``edge_pad_copy``: its interior reads a padded copy of its region at a global edge
    (False: the outputs that read padding are shells). The defaults are the layers'
    today; ``tests/test_spatial_memory.py`` measures them (an earlier version kept 2
    copies per BatchNorm and the halo'd input: 0.79 of one rank's bytes at P = 2)."""

    norm_whole: float = 1.0  # torch's BatchNorm keeps its input
    norm_region: float = 1.0
    halo_copy: bool = False
    edge_pad_copy: bool = False

    def __post_init__(self) -> None:
        for name in ("norm_whole", "norm_region"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0):
                raise ConfigError(f"SavedCopies({name}={value!r}): a number >= 0")


@dataclass
class RankCost:
    """One rank's share of one step: per layer seconds of compute and of halo traffic,
    and the bytes it keeps."""

    compute_s: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    voxels: list[int] = field(default_factory=list)  # local output voxels per sample
    interior: list[float] = field(default_factory=list)  # share computable before the halo
    halo_s: list[tuple[float, ...]] = field(default_factory=list)  # per split dim
    halo_bytes: int = 0
    saved_bytes: int = 0


def _prod(values: Sequence[int]) -> int:
    return math.prod(values) if values else 1


def work_voxels(kind: str, in_ext: Sequence[int], out_ext: Sequence[int]) -> int:
    """The voxels a layer's time is fitted against: its outputs', but a reduction's (and
    a gather's) inputs', whose outputs are tiny or whole."""
    return _prod(in_ext) if kind in ("reduce", "gather") else _prod(out_ext)


def representative_coords(grid: Sequence[int]) -> list[tuple[int, ...]]:
    """The ranks whose costs differ on an even split: the two at each edge and one in
    the middle of every grid dimension (all ranks of a small grid)."""
    per_dim = [sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n))) for n in grid]
    coords: list[tuple[int, ...]] = [()]
    for values in per_dim:
        coords = [(*c, v) for c in coords for v in values]
    return coords


def _any_halo(owned: Sequence[Interval], needs: Sequence[Interval]) -> bool:
    """Whether any rank of the line reads rows another owns (then the layer builds a
    halo plan on every rank, as ``SpatialModule._dim_splits`` does)."""
    return any(
        hi > lo and not (own[0] <= lo and hi <= own[1])
        for own, (lo, hi) in zip(owned, needs, strict=True)
    )


@dataclass(frozen=True)
class _DimGeometry:
    own: Interval  # input rows this rank holds
    out: Interval  # output rows it computes
    need: Interval  # input rows those read (clipped to the extent)
    inner: Interval  # outputs computable from its own rows
    recv_rows: int
    send_rows: int
    messages: int
    halo: bool  # the layer exchanges along this dimension (on some rank)


@functools.lru_cache(maxsize=4096)
def _dim_geometry(
    window: Window | None, n_in: int, n_out: int, parts: int, me: int
) -> _DimGeometry:
    owned = split_extent(n_in, parts)
    outs = split_extent(n_out, parts)
    if window is None:  # pointwise, norm: the output region is the input region
        return _DimGeometry(owned[me], owned[me], owned[me], owned[me], 0, 0, 0, False)
    needs = [clip(window.needed(o), n_in) for o in outs]
    traffic = exchange(me, owned, needs)
    inside = window.inside(owned[me])
    out = outs[me]
    inner = (max(inside[0], out[0]), min(inside[1], out[1]))
    recv = sum(hi - lo for _, (lo, hi) in traffic.recvs)
    send = sum(hi - lo for _, (lo, hi) in traffic.sends)
    messages = max(len(traffic.recvs), len(traffic.sends))
    return _DimGeometry(
        owned[me], out, needs[me], inner, recv, send, messages, _any_halo(owned, needs)
    )


def rank_cost(
    model: LayoutModel,
    dims: Sequence[int],
    grid: Sequence[int],
    coords: Sequence[int],
    batch: int,
    link: Link,
) -> RankCost:
    """The rank at ``coords`` of ``grid`` (split spatial dims ``dims``; none: the whole
    sample) running ``model.layers`` at local ``batch``: per-layer compute and halo
    seconds from ``model.fits`` and ``link``, and the bytes it keeps for backward."""
    layers, fits, saved = model.layers, model.fits, model.saved
    region_fits, bpe = model.region_fits, model.bytes_per_element
    spatial = len(grid) > 0
    cost = RankCost()
    keep: dict[object, int] = {}  # saved tensors, each once (autograd counts storages)
    current: object = ("input",)
    region = True  # the layers up to the first gather or reduction run on a region
    for index, layer in enumerate(layers):
        on_region = spatial and region and layer.kind in REGION_KINDS
        in_ext, out_ext = list(layer.in_shape[1:]), list(layer.out_shape[1:])
        geo: list[_DimGeometry] = []
        if on_region:
            windowed = layer.kind in ("conv", "pool")
            for i, d in enumerate(dims):
                window = layer.windows[d] if windowed else None
                geo.append(_dim_geometry(window, in_ext[d], out_ext[d], grid[i], coords[i]))
            for g, d in zip(geo, dims, strict=True):
                in_ext[d] = g.own[1] - g.own[0]
                if layer.kind not in WHOLE_AFTER:
                    out_ext[d] = g.out[1] - g.out[0]
        in_elems = layer.in_shape[0] * _prod(in_ext) * batch
        out_elems = layer.out_shape[0] * _prod(out_ext) * batch
        voxels = work_voxels(layer.kind, in_ext, out_ext)
        calls, interior, halo = 1, 1.0, []
        if on_region and layer.kind in ("conv", "pool"):
            calls, interior = _pieces(geo, voxels, out_ext, dims)
            halo = _halo_seconds(geo, dims, layer.in_shape, batch, bpe, link)
            cost.halo_bytes += _halo_bytes(geo, dims, layer.in_shape, batch, bpe)
        fit = (region_fits.get(layer.name) if on_region else None) or fits.get(layer.name)
        seconds = 0.0 if fit is None else fit.seconds(voxels, batch, calls)
        cost.compute_s.append(seconds)
        cost.calls.append(calls)
        cost.voxels.append(voxels)
        cost.interior.append(interior)
        cost.halo_s.append(tuple(halo))
        # what autograd keeps (see SavedCopies and docs/costmodel.md)
        kind, variant = layer.kind, layer.variant
        out_key: object = ("out", index)
        if kind in ("conv", "pool"):
            if on_region:
                _windowed_saves(keep, geo, dims, layer, batch, bpe, index, current, in_elems, saved)
            else:
                keep[current] = in_elems * bpe
            if kind == "pool" and variant == "max":
                keep[("indices", index)] = out_elems * INDEX_BYTES
        elif kind == "norm":
            if on_region:
                keep[("norm", index)] = int(saved.norm_region * out_elems * bpe)
            else:
                copies = saved.norm_whole
                if copies == 1.0:
                    keep[current] = in_elems * bpe
                else:
                    keep[("norm", index)] = int(copies * in_elems * bpe)
        elif kind == "pointwise":
            if variant == "view":
                out_key = current
            elif variant != "free":
                keep[out_key] = out_elems * bpe
        elif kind == "dense":
            if variant == "view":
                out_key = current
            elif variant != "free":
                keep[current] = in_elems * bpe
        current = out_key
        if kind in WHOLE_AFTER:
            region = False
    cost.saved_bytes = sum(keep.values())
    return cost


def _pieces(
    geo: Sequence[_DimGeometry], voxels: int, out_ext: Sequence[int], dims: Sequence[int]
) -> tuple[int, float]:
    """(calls, interior share) of a partitioned windowed layer: the interior box, then
    a slab on each side of it per split dimension (``WindowedLayer._shells``)."""
    calls = 1
    inner_voxels = voxels
    for g, d in zip(geo, dims, strict=True):
        lo, hi = g.out
        ilo, ihi = g.inner
        extent = max(1, out_ext[d])
        if ihi <= ilo:
            return calls, 0.0
        calls += (ilo > lo) + (hi > ihi)
        inner_voxels = inner_voxels * (ihi - ilo) // extent
    return calls, (inner_voxels / voxels) if voxels else 0.0


def _slab_elements(
    geo: Sequence[_DimGeometry], dims: Sequence[int], shape: Sequence[int], i: int, batch: int
) -> int:
    """Elements per halo row along split dim ``i``: the dims assembled before it at
    their needed rows, those after at the rank's own rows."""
    ext = list(shape[1:])
    for j, (g, d) in enumerate(zip(geo, dims, strict=True)):
        if j != i:
            rows = g.need if j < i and g.halo else g.own
            ext[d] = rows[1] - rows[0]
    ext[dims[i]] = 1
    return shape[0] * _prod(ext) * batch


def _halo_seconds(geo, dims, shape, batch, bpe, link) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for i, g in enumerate(geo):
        if not g.halo or g.messages == 0:
            out.append(0.0)
            continue
        nbytes = max(g.recv_rows, g.send_rows) * _slab_elements(geo, dims, shape, i, batch) * bpe
        out.append(g.messages * link.latency_s + nbytes / link.bandwidth)
    return out


def _halo_bytes(geo, dims, shape, batch, bpe) -> int:  # type: ignore[no-untyped-def]
    return sum(
        g.recv_rows * _slab_elements(geo, dims, shape, i, batch) * bpe for i, g in enumerate(geo)
    )


def _windowed_saves(keep, geo, dims, layer, batch, bpe, index, current, in_elems, saved) -> None:  # type: ignore[no-untyped-def]
    """A partitioned convolution or pooling keeps the input of each box it computes:
    the interior reads its own rows (a padded copy at a global edge), the shells read
    the halo'd input (``WindowedLayer.forward``)."""
    interior_empty = any(g.inner[1] <= g.inner[0] for g in geo)
    shells = interior_empty or any(g.inner != g.out for g in geo)
    has_halo = any(g.halo for g in geo)
    if not interior_empty:
        pads, ext = False, list(layer.in_shape[1:])
        for g, d in zip(geo, dims, strict=True):
            w = layer.windows[d]
            lo, hi = w.needed(g.inner)
            pads = pads or lo < 0 or hi > layer.in_shape[1 + d]
            ext[d] = hi - lo
        if pads and saved.edge_pad_copy:
            keep[("pad", index)] = layer.in_shape[0] * _prod(ext) * batch * bpe
        else:
            keep[current] = in_elems * bpe
    if shells and has_halo and saved.halo_copy:
        ext = list(layer.in_shape[1:])
        for g, d in zip(geo, dims, strict=True):
            rows = g.need if g.halo else g.own
            ext[d] = rows[1] - rows[0]
        keep[("need", index)] = layer.in_shape[0] * _prod(ext) * batch * bpe
    elif shells and has_halo:
        for key, elements in _shell_inputs(geo, dims, layer, index):
            keep[key] = elements * batch * bpe
    elif shells:
        keep[current] = in_elems * bpe


def _shell_inputs(geo, dims, layer, index):  # type: ignore[no-untyped-def]
    """The input each shell box reads (``WindowedLayer._shells``: along split dim ``i``,
    a slab on each side of the interior, spanning the interior along the dims before
    ``i`` and all outputs along those after), as (key, elements per sample)."""
    found = []
    for i, g in enumerate(geo):
        if g.inner[1] <= g.inner[0]:
            box = [x.inner if j < i else x.out for j, x in enumerate(geo)]
            found.append((("shell", index, i, 0), _box_input(box, dims, layer)))
            break
        for side, rows in enumerate(((g.out[0], g.inner[0]), (g.inner[1], g.out[1]))):
            if rows[1] > rows[0]:
                box = [x.inner if j < i else x.out for j, x in enumerate(geo)]
                box[i] = rows
                found.append((("shell", index, i, side), _box_input(box, dims, layer)))
    return found


def _box_input(box, dims, layer) -> int:  # type: ignore[no-untyped-def]
    ext = list(layer.in_shape[1:])
    for (lo, hi), d in zip(box, dims, strict=True):
        a, b = layer.windows[d].needed((lo, hi))
        ext[d] = b - a
    return layer.in_shape[0] * _prod(ext)
