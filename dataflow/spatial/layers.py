"""Partitioned layers: each computes its rank's region of the layer's output.

They hold the original layer's parameters and buffers (the same tensors, under the
same names), so a partitioned model's ``state_dict`` is the unpartitioned model's.
The per-forward geometry (:class:`DimSplit`, set by ``SpatialModule`` from the global
input shape) says which rows each rank owns and which arrive as halo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dataflow.spatial.comm import (
    HaloPlan,
    PendingHalo,
    SpatialGroup,
    allreduce_sum,
    anchor,
    gather,
    halo_receive,
)
from dataflow.spatial.geometry import Interval, Window
from dataflow.stages.group_batchnorm import BatchNormState, GroupBatchNormFunction, ReplicaGroup


@dataclass(frozen=True)
class DimSplit:
    """One split dimension of one windowed layer, on one rank (global rows)."""

    dim: int  # tensor dimension
    window: Window
    n_in: int
    own: Interval  # input rows this rank holds
    out: Interval  # output rows it computes
    inside: Interval  # of those, the ones computable from ``own`` alone
    halo: HaloPlan | None  # None: nothing moves along this dimension


class _Rows:
    """What a rank holds of a layer's input: ``tensor`` covering global ``rows`` per split
    dimension, plus, along one dimension, the halo slabs beside it (kept apart, so that
    an output slab copies only the few rows it reads, never the whole region)."""

    def __init__(self, tensor: torch.Tensor, rows: list[Interval]) -> None:
        self.tensor, self.rows = tensor, list(rows)
        self.blocked: int | None = None  # split index whose slabs are kept apart
        self.blocks: list[tuple[Interval, torch.Tensor]] = []

    def with_halo(self, i: int, dim: int, slabs: list, *, last: bool) -> _Rows:
        blocks = sorted([*slabs, (self.rows[i], self.tensor)], key=lambda b: b[0][0])
        span = (blocks[0][0][0], blocks[-1][0][1])
        if not last:  # a later dimension's halo must carry these rows (the corners)
            out = _Rows(torch.cat([t for _, t in blocks], dim), self.rows)
            out.rows[i] = span
            return out
        out = _Rows(self.tensor, self.rows)
        out.blocked, out.blocks = i, blocks
        return out

    def take(self, dims: list[int], wanted: list[Interval]) -> torch.Tensor:
        """Rows ``wanted`` per split dimension: views, or a small copy where a slab's rows
        span the region's edge and a halo slab."""
        parts = [(self.rows, self.tensor)] if self.blocked is None else []
        for rows, t in self.blocks:
            parts.append(([*self.rows[: self.blocked], rows, *self.rows[self.blocked + 1 :]], t))
        pieces = []
        for rows, t in parts:
            if self.blocked is not None:
                lo, hi = wanted[self.blocked]
                r = rows[self.blocked]
                if min(hi, r[1]) <= max(lo, r[0]):
                    continue
            for k, (dim, (lo, hi)) in enumerate(zip(dims, wanted, strict=True)):
                if self.blocked is not None and k == self.blocked:
                    lo, hi = max(lo, rows[k][0]), min(hi, rows[k][1])
                assert rows[k][0] <= lo and hi <= rows[k][1], (rows, wanted)
                t = t.narrow(dim, lo - rows[k][0], hi - lo)
            pieces.append(t)
        if not pieces:  # the rows lie all in the padding: an empty slab, padded later
            t = self.tensor
            for k, (dim, (lo, hi)) in enumerate(zip(dims, wanted, strict=True)):
                start = 0 if k == self.blocked else lo - self.rows[k][0]
                t = t.narrow(dim, start, 0 if k == self.blocked else hi - lo)
            return t
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces, dims[self.blocked])


def _pairs(value: Any, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


class WindowedLayer(nn.Module):
    """Convolution or pooling over a region, the interior computed while the halo is
    in flight; ``splits`` is None when the input is whole on every rank."""

    fill = 0.0  # what lies beyond the global edges (max pooling: -inf)

    def __init__(self, original: nn.Module, nd: int) -> None:
        super().__init__()
        self.nd = nd
        self.original_type = type(original).__name__
        self.splits: tuple[DimSplit, ...] | None = None
        self.out_channels = 0

    def windows(self) -> tuple[Window, ...]:
        raise NotImplementedError

    def compute(self, x: torch.Tensor, split_dims: frozenset[int]) -> torch.Tensor:
        """The op on ``x``, with no padding along ``split_dims`` (already explicit)."""
        raise NotImplementedError

    def finish(self, out: torch.Tensor, box: Sequence[Interval]) -> torch.Tensor:
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.splits:
            return self.compute(x, frozenset())
        splits = self.splits
        halos = [i for i, s in enumerate(splits) if s.halo is not None]
        pending = PendingHalo(splits[halos[0]].halo, x) if halos else None
        inner = [(max(s.inside[0], s.out[0]), min(s.inside[1], s.out[1])) for s in splits]
        source = _Rows(x, [s.own for s in splits])
        interior = self._box(source, inner)  # from views of x, while the first halo travels
        tokens = []
        for n, i in enumerate(halos):
            step = pending if n == 0 else PendingHalo(splits[i].halo, source.tensor)
            token, slabs = halo_receive(source.tensor, step)
            tokens.append(token)
            source = source.with_halo(i, splits[i].dim, slabs, last=n == len(halos) - 1)
        out = self._shells(source, [s.out for s in splits], inner, interior, 0)
        for token in tokens:
            out = anchor(out, token)
        if out.numel() == 0 and x.requires_grad:  # no output here: keep x's upstream
            out = anchor(out, x.sum())  # collectives in this rank's backward
        return out

    def _shells(self, source, box, inner, interior, i):  # type: ignore[no-untyped-def]
        """Outputs ``box`` as slabs around the interior, one split dimension at a time."""
        if i == len(box):
            return interior
        dim = self.splits[i].dim
        lo, hi = box[i]
        ilo, ihi = inner[i]
        if ihi <= ilo:  # no interior along this dimension: the whole box is shell
            return self._box(source, box)
        low = self._box(source, [*box[:i], (lo, ilo), *box[i + 1 :]])
        high = self._box(source, [*box[:i], (ihi, hi), *box[i + 1 :]])
        middle_box = [*box[:i], (ilo, ihi), *box[i + 1 :]]
        middle = self._shells(source, middle_box, inner, interior, i + 1)
        return torch.cat([low, middle, high], dim)

    def _box(self, source: _Rows, box: Sequence[Interval]) -> torch.Tensor:
        """The outputs ``box`` (per split dimension) from ``source``'s rows."""
        if any(hi <= lo for lo, hi in box):
            return self._empty(source.tensor, box)
        wanted, pads = [], {}
        for s, out in zip(self.splits, box, strict=True):
            a, b = s.window.needed(out)
            ca, cb = max(a, 0), min(b, s.n_in)
            wanted.append((ca, cb))
            pads[s.dim] = (ca - a, b - cb)
        t = source.take([s.dim for s in self.splits], wanted)
        if any(p for pair in pads.values() for p in pair):
            spec: list[int] = []
            for dim in range(t.dim() - 1, 1, -1):
                spec.extend(pads.get(dim, (0, 0)))
            t = F.pad(t, spec, value=self.fill)
        return self.finish(self.compute(t, frozenset(s.dim for s in self.splits)), box)

    def _empty(self, source: torch.Tensor, box: Sequence[Interval]) -> torch.Tensor:
        shape = [source.shape[0], self.out_channels or source.shape[1], *self._full_out]
        for s, (lo, hi) in zip(self.splits, box, strict=True):
            shape[s.dim] = max(0, hi - lo)
        return source.new_zeros(shape)

    _full_out: tuple[int, ...] = ()  # global output extents, set with ``splits``


def _conv_pads(conv: nn.modules.conv._ConvNd) -> tuple[tuple[int, int], ...]:
    nd = len(conv.kernel_size)
    if conv.padding == "valid":
        return ((0, 0),) * nd
    if conv.padding == "same":
        pads = []
        for k, d in zip(conv.kernel_size, conv.dilation, strict=True):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    return tuple((p, p) for p in _pairs(conv.padding, nd))


class SpatialConv(WindowedLayer):
    """Conv1d/2d/3d with zero padding: any kernel, stride, padding, dilation, groups."""

    def __init__(self, conv: nn.modules.conv._ConvNd) -> None:
        nd = len(conv.kernel_size)
        super().__init__(conv, nd)
        self.weight = conv.weight
        self.bias = conv.bias
        self.stride, self.dilation, self.groups = conv.stride, conv.dilation, conv.groups
        self.pads = _conv_pads(conv)
        self.kernel_size = conv.kernel_size
        self.out_channels = conv.out_channels
        self._op = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]

    def windows(self) -> tuple[Window, ...]:
        return tuple(
            Window(k, s, d, lo, hi)
            for k, s, d, (lo, hi) in zip(
                self.kernel_size, self.stride, self.dilation, self.pads, strict=True
            )
        )

    def compute(self, x: torch.Tensor, split_dims: frozenset[int]) -> torch.Tensor:
        pads = [(0, 0) if i + 2 in split_dims else p for i, p in enumerate(self.pads)]
        if all(lo == hi for lo, hi in pads):
            padding = tuple(lo for lo, _ in pads)
        else:  # asymmetric ('same' with an even kernel): pad explicitly
            spec = [v for lo, hi in reversed(pads) for v in (lo, hi)]
            x, padding = F.pad(x, spec), (0,) * self.nd
        return self._op(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class SpatialMaxPool(WindowedLayer):
    fill = float("-inf")

    def __init__(self, pool: nn.modules.pooling._MaxPoolNd, nd: int) -> None:
        super().__init__(pool, nd)
        self.kernel_size = _pairs(pool.kernel_size, nd)
        self.stride = _pairs(pool.stride or pool.kernel_size, nd)
        self.padding = _pairs(pool.padding, nd)
        self.dilation = _pairs(pool.dilation, nd)
        self.ceil_mode = pool.ceil_mode
        self._op = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]

    def windows(self) -> tuple[Window, ...]:
        return tuple(
            Window(k, s, d, p, p, self.ceil_mode)
            for k, s, d, p in zip(
                self.kernel_size, self.stride, self.dilation, self.padding, strict=True
            )
        )

    def compute(self, x: torch.Tensor, split_dims: frozenset[int]) -> torch.Tensor:
        padding = tuple(0 if i + 2 in split_dims else p for i, p in enumerate(self.padding))
        return self._op(x, self.kernel_size, self.stride, padding, self.dilation, self.ceil_mode)


class SpatialAvgPool(WindowedLayer):
    def __init__(self, pool: nn.Module, nd: int) -> None:
        super().__init__(pool, nd)
        self.kernel_size = _pairs(pool.kernel_size, nd)
        self.stride = _pairs(pool.stride or pool.kernel_size, nd)
        self.padding = _pairs(pool.padding, nd)
        self.ceil_mode = pool.ceil_mode
        self.count_include_pad = pool.count_include_pad
        self.divisor_override = getattr(pool, "divisor_override", None)

    def windows(self) -> tuple[Window, ...]:
        return tuple(
            Window(k, s, 1, p, p, self.ceil_mode)
            for k, s, p in zip(self.kernel_size, self.stride, self.padding, strict=True)
        )

    def compute(self, x: torch.Tensor, split_dims: frozenset[int]) -> torch.Tensor:
        padding = tuple(0 if i + 2 in split_dims else p for i, p in enumerate(self.padding))
        args = (self.kernel_size, self.stride, padding, self.ceil_mode, self.count_include_pad)
        if self.nd == 1:  # avg_pool1d has no divisor_override
            return F.avg_pool1d(x, *args)
        op = F.avg_pool2d if self.nd == 2 else F.avg_pool3d
        return op(x, *args, self.divisor_override)

    def finish(self, out: torch.Tensor, box: Sequence[Interval]) -> torch.Tensor:
        """Along a split dimension the op saw whole windows (explicit padding); rescale
        each output to torch's divisor for its window."""
        if self.divisor_override or not self.splits:
            return out
        for s, (lo, hi) in zip(self.splits, box, strict=True):
            k, stride, pad = s.window.kernel, s.window.stride, s.window.pad_lo
            starts = torch.arange(lo, hi, device=out.device) * stride - pad
            ends = torch.minimum(starts + k, torch.tensor(s.n_in + pad, device=out.device))
            if not self.count_include_pad:
                starts, ends = starts.clamp(min=0), ends.clamp(max=s.n_in)
            factor = k / (ends - starts).to(out.dtype)
            shape = [1] * out.dim()
            shape[s.dim] = hi - lo
            out = out * factor.view(shape)
        return out


class SpatialBatchNorm(BatchNormState):
    """BatchNorm whose batch statistics are reduced over the spatial group (one
    allreduce of each rank's moments, ``stages.group_batchnorm``); with
    ``sync_batchnorm``, over every worker of the fit (``replicas``: each sample group's
    regions of its samples, each rank's part scaled by its group's share)."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__(bn)
        self.group: SpatialGroup | None = None
        self.replicas: ReplicaGroup | None = None  # Forward(sync_batchnorm=True) sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_batch = self.training or not self.track_running_stats
        if not use_batch or self.group is None:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias,
                use_batch, self.momentum or 0.0, self.eps,
            )  # fmt: skip
        group, share = self.group, 1.0
        if self.replicas is not None and self.replicas.size > 1:  # every worker of the fit
            group, share = self.replicas, self.replicas.share
        y, mean, var, count = GroupBatchNormFunction.apply(
            x, self.weight, self.bias, group, self.eps, None, share
        )
        if self.training and self.track_running_stats:
            self._update_running(mean, var, count)
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        self.num_batches_tracked += 1
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.mul_(1 - m).add_(mean, alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased, alpha=m)


class Gather(nn.Module):
    """The whole tensor on every rank, before the first layer that needs it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.group: SpatialGroup | None = None
        self.box: tuple[tuple[int, Interval], ...] = ()
        self.full: tuple[int, ...] = ()  # global extents past the batch dimension

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather(x, self.group, self.box, (x.shape[0], *self.full))


class GlobalAvgPool(nn.Module):
    """AdaptiveAvgPool to size 1 as a reduction: a sum per rank, one small allreduce."""

    def __init__(self, nd: int) -> None:
        super().__init__()
        self.nd = nd
        self.group: SpatialGroup | None = None
        self.count = 1  # voxels of the whole sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(2, x.dim()))
        return allreduce_sum(x.sum(dims, keepdim=True), self.group) / self.count


class SharedDropout(nn.Module):
    """Dropout whose mask is drawn for the whole tensor from a generator seeded alike on
    every rank of the group, each rank keeping its region: the ranks agree (also on the
    replicated layers after the gather), whatever their regions."""

    def __init__(self, dropout: nn.Module) -> None:
        super().__init__()
        self.p = dropout.p
        self.generator: torch.Generator | None = None
        self.box: tuple[tuple[int, Interval], ...] = ()
        self.full: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        full = (x.shape[0], *self.full) if self.full else tuple(x.shape)
        keep = torch.rand(full, generator=self.generator) >= self.p
        for dim, (lo, hi) in self.box:
            keep = keep.narrow(dim, lo, hi - lo)
        return x * keep.to(device=x.device, dtype=x.dtype) / (1.0 - self.p)
