"""The communication of a spatial group, each as an autograd function with its adjoint.

The group's objective is the sum of its ranks' objectives (each rank scales its loss
by 1/P, see :class:`~dataflow.spatial.module.SpatialModule`), so every adjoint is the
plain transpose: a halo copy's gradient goes back to the rank that owns the rows and
adds there; an allreduce-sum's gradient is an allreduce-sum; a gather's gradient is a
reduce-scatter. Halo slabs are packed with the ``ops.halo`` kernel (CPU and CUDA) and
received straight into their own buffers: a rank never copies its whole region.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.ops.halo import PACK_HALO, pack_halo
from dataflow.spatial.geometry import Exchange, Interval, coords_of, rank_of


class SpatialGroup:
    """The ``size`` workers that share each sample, as a grid over the split dimensions.

    ``process_group`` is any c10d process group (``send``/``recv``/``allreduce`` taking
    tensor lists), such as ``torch.distributed.group.WORLD`` or one the engine builds.
    ``wait`` waits for a collective's work handle (the engine passes one that fails at
    once when the fit is aborted).
    """

    def __init__(
        self,
        process_group: Any,
        *,
        rank: int,
        size: int,
        grid: Sequence[int],
        wait: Callable[[Any], None] | None = None,
    ) -> None:
        self.process_group = process_group
        self.rank = rank
        self.size = size
        self.grid = tuple(grid)
        self.coords = coords_of(rank, self.grid)
        self._wait = wait or (lambda work: work.wait())

    def peer(self, dim_index: int, coord: int) -> int:
        """The rank that differs from this one only in coordinate ``dim_index``."""
        coords = list(self.coords)
        coords[dim_index] = coord
        return rank_of(coords, self.grid)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        if self._through_host(tensor):
            tensor = tensor.cpu()  # kept alive by the work until it is waited for
            return _Staged(self.process_group.send([tensor], dst, tag), tensor)
        return self.process_group.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        if self._through_host(tensor):
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            return _Staged(self.process_group.recv([host], src, tag), host, into=tensor)
        return self.process_group.recv([tensor], src, tag)

    def _through_host(self, tensor: torch.Tensor) -> bool:
        """gloo moves CUDA tensors in collectives but not point to point (its CUDA
        send/recv ends in ``writev: Bad address``): such slabs go through host memory.
        NCCL sends from the GPU."""
        return tensor.is_cuda and self._backend == "gloo"

    @property
    def _backend(self) -> str:
        name = getattr(self.process_group, "name", None)
        return name() if callable(name) else ""

    def wait(self, works: Sequence[Any]) -> None:
        """Wait for point-to-point work: gloo's send/recv complete only inside ``wait()``
        (``is_completed`` stays False), so no polling here; a vanished peer fails the
        wait (connection closed, or the group's timeout)."""
        for work in works:
            work.wait()

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place."""
        if self.size > 1:
            self._wait(self.process_group.allreduce([tensor]))
        return tensor


def _pack(x: torch.Tensor, dim: int, width: int, offset: int) -> torch.Tensor:
    """The slab to send. On a GPU torch's strided copy: measured on an H100
    (``benchmarks/bench_gpu.py``), the Numba kernel's launch from Python costs 0.26-0.53
    ms per slab against torch's 0.02-0.04 ms for the same copy, and a layer sends
    several slabs per step. On the CPU the Numba kernel (parallel over rows), for the
    dtypes it takes (float32, float64); bf16 activations (``precision="bf16"``, which Numba
    has no type for) by torch's copy."""
    if x.is_cuda or x.dtype not in PACK_HALO.dtypes:
        return x.narrow(dim, offset, width).contiguous()
    return pack_halo(x, dim, width, "low", offset=offset)


class _Staged:
    """A point-to-point work through a host buffer; a receive copies into ``into`` (the
    device tensor) once it has arrived."""

    def __init__(self, work: Any, host: torch.Tensor, into: torch.Tensor | None = None) -> None:
        self.work, self.host, self.into = work, host, into

    def wait(self) -> bool:
        self.work.wait()
        if self.into is not None:
            self.into.copy_(self.host)
        return True


# -- halo exchange along one dimension ---------------------------------------------------


@dataclass(frozen=True)
class HaloPlan:
    """One rank's halo along one tensor dimension: it owns ``own`` and needs ``need``
    (both global rows, ``need`` clipped to the extent); ``traffic`` says what moves."""

    group: SpatialGroup
    dim: int  # tensor dimension (2 = first spatial)
    dim_index: int  # which grid dimension it is split over
    own: Interval
    need: Interval
    traffic: Exchange
    tag: int  # distinct per layer and dimension; the backward uses tag + 1

    def _post_sends(
        self, x: torch.Tensor, rows_of: Sequence[tuple[int, Interval]], base: int, tag: int
    ) -> list[Any]:
        works = []
        for coord, (lo, hi) in rows_of:
            slab = _pack(x, self.dim, hi - lo, lo - base)
            works.append(self.group.send(slab, self.group.peer(self.dim_index, coord), tag))
            works.append(slab)  # keep the buffer alive until the send is waited for
        return works


class PendingHalo:
    """Sends posted and receives in flight for one :class:`HaloPlan`: the caller computes
    the interior meanwhile, then :func:`halo_receive` waits for the slabs."""

    def __init__(self, plan: HaloPlan, x: torch.Tensor) -> None:
        self.plan = plan
        self.pieces: list[tuple[Interval, torch.Tensor]] = []
        sent = plan._post_sends(x.detach(), plan.traffic.sends, plan.own[0], plan.tag)
        self.sends = [w for w in sent if not isinstance(w, torch.Tensor)]
        self.buffers = [w for w in sent if isinstance(w, torch.Tensor)]
        self.recvs = []
        for coord, (lo, hi) in plan.traffic.recvs:
            shape = list(x.shape)
            shape[plan.dim] = hi - lo
            slab = torch.empty(shape, dtype=x.dtype, device=x.device)
            self.recvs.append(
                plan.group.recv(slab, plan.group.peer(plan.dim_index, coord), plan.tag)
            )
            self.pieces.append(((lo, hi), slab))

    def wait(self) -> None:
        self.plan.group.wait(self.recvs + self.sends)


class _HaloReceive(torch.autograd.Function):
    """Waits for the halo; returns a token (see :func:`anchor`) and the received slabs.
    Its backward sends each slab's gradient to the rows' owner and adds what the peers
    send back into this rank's rows: the adjoint of the copy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: PendingHalo) -> tuple[torch.Tensor, ...]:
        pending.wait()
        ctx.plan, ctx.own_shape = pending.plan, tuple(x.shape)
        ctx.dtype, ctx.device = x.dtype, x.device
        token = x.new_zeros(())
        return (token, *(slab for _, slab in pending.pieces))

    @staticmethod
    def backward(ctx: Any, _token: Any, *grads: Any) -> tuple[torch.Tensor, None]:
        plan: HaloPlan = ctx.plan
        tag = plan.tag + 1
        works = []
        for (coord, (lo, hi)), grad in zip(plan.traffic.recvs, grads, strict=True):
            if grad is None:  # a slab no output read (an empty region): zeros go back
                shape = list(ctx.own_shape)
                shape[plan.dim] = hi - lo
                grad = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
            grad = grad.contiguous()
            works += [plan.group.send(grad, plan.group.peer(plan.dim_index, coord), tag), grad]
        incoming = []
        for coord, (lo, hi) in plan.traffic.sends:
            shape = list(ctx.own_shape)
            shape[plan.dim] = hi - lo
            slab = torch.empty(shape, dtype=ctx.dtype, device=ctx.device)
            works.append(plan.group.recv(slab, plan.group.peer(plan.dim_index, coord), tag))
            incoming.append(((lo, hi), slab))
        grad_x = torch.zeros(ctx.own_shape, dtype=ctx.dtype, device=ctx.device)
        plan.group.wait([w for w in works if not isinstance(w, torch.Tensor)])
        for (lo, hi), slab in incoming:  # peers' needs may overlap: add, never overwrite
            grad_x.narrow(plan.dim, lo - plan.own[0], hi - lo).add_(slab)
        return grad_x, None


def halo_receive(
    x: torch.Tensor, pending: PendingHalo
) -> tuple[torch.Tensor, list[tuple[Interval, torch.Tensor]]]:
    """Wait for ``pending``'s halo: a token to :func:`anchor` into the layer's output, and
    the received slabs by global rows (differentiable; ``x``'s own rows are not copied,
    so a rank keeps one copy of its region plus the halo)."""
    token, *slabs = _HaloReceive.apply(x, pending)
    rows = [r for r, _ in pending.pieces]
    return token, list(zip(rows, slabs, strict=True))


class _Anchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(())


def anchor(out: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, with ``token``'s node upstream of it: every rank then runs its
    halo's backward (its peers wait for the gradient), also one whose outputs read no
    halo row or that owns no output at all. Costs nothing."""
    return _Anchor.apply(out, token)


# -- reductions over the group ------------------------------------------------------------


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: SpatialGroup) -> torch.Tensor:
        ctx.group = group
        return group.allreduce_(x.detach().clone().contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.allreduce_(grad.detach().clone().contiguous()), None


def allreduce_sum(x: torch.Tensor, group: SpatialGroup) -> torch.Tensor:
    """The sum of ``x`` over the group, on every rank; differentiable."""
    return _AllReduceSum.apply(x, group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: SpatialGroup,
        box: tuple[tuple[int, Interval], ...],
        full: tuple[int, ...],
    ) -> torch.Tensor:
        out = x.new_zeros(full)
        _region(out, box).copy_(x)
        ctx.group, ctx.box = group, box
        return group.allreduce_(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        summed = ctx.group.allreduce_(grad.detach().clone().contiguous())
        return _region(summed, ctx.box).contiguous(), None, None, None


def gather(
    x: torch.Tensor, group: SpatialGroup, box: Sequence[tuple[int, Interval]], full: Sequence[int]
) -> torch.Tensor:
    """The whole tensor (shape ``full``) on every rank, from each rank's ``box``
    (``(tensor dim, rows)`` per split dimension). Built as an allreduce of zero-filled
    copies: twice an allgather's traffic, but uneven regions and any grid need nothing
    more; the adjoint is a reduce-scatter."""
    return _Gather.apply(x, group, tuple(box), tuple(full))


def _region(t: torch.Tensor, box: Sequence[tuple[int, Interval]]) -> torch.Tensor:
    for dim, (lo, hi) in box:
        t = t.narrow(dim, lo, hi - lo)
    return t


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; its gradient multiplied by ``scale``."""
    return _ScaleGrad.apply(x, scale)
