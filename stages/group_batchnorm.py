"""BatchNorm whose batch statistics are those of a batch spread over a group of ranks.

Two groups use it: the fit's replicas, each holding its local batch of the global one
(``Forward(sync_batchnorm=True)``: torch's SyncBatchNorm, exact for any split), and a
spatial group's ranks, each holding a region of the same samples
(``dataflow.spatial``). The statistics are one allreduce per layer forward (the
per-channel sums and sums of squares, in float64, and the count unless the caller
knows it), the adjoint one per layer backward (the per-channel sums of the gradient
and of the gradient times the normalised input): each ``O(C)``, whatever the group's
size.

Replicas split a global batch unevenly (``b_r`` samples of ``B``), and each one's
gradient is of its own local mean loss, weighted by its share ``b_r / B`` only in the
gradient allreduce. The backward's sums must add gradients of one loss, so each rank
puts in its gradient times its ``share`` (the global mean's), and takes back its
input gradient divided by it again (the allreduce weights it then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class BatchGroup(Protocol):
    """The ranks a batch is spread over: ``allreduce_`` sums a tensor over them in place."""

    rank: int
    size: int

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor: ...


def group_moments(
    x: torch.Tensor,
    group: BatchGroup,
    dims: list[int],
    shape: list[int],
    count: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """Per-channel mean and biased variance over the group's whole batch in ONE
    collective of ``2C`` floats (``1 + 2C`` when the count is not known), and ``x -
    mean`` (to be normalised in place).

    Each rank computes its own mean ``m_i`` and centred sum of squares ``M2_i`` (a second
    pass over its values, as stable as torch's), and puts in ``n_i m_i`` and ``M2_i +
    n_i m_i^2`` in float64; the sums give the mean and ``E[x^2] - mean^2``, in which
    float64 absorbs the cancellation unless ``|mean| / std`` passes ~1e6. One collective
    saves a second synchronisation point (each rank waits for the slowest at each), and
    its size does not grow with the group: gathering every rank's row (Chan's merge, as
    torch's SyncBatchNorm all-gathers) moved ``P × (1 + 2C)`` floats, 16 MiB for one
    2,048-channel layer over 1,024 replicas. ``count``: the group's elements per channel
    when the caller knows it (no read of the device's sums: no host sync), else summed
    with the rest.
    """
    channels = x.shape[1]
    n = x.numel() / max(1, channels)
    local_mean = x.mean(dims) if n else x.new_zeros(channels)
    y = x - local_mean.view(shape)
    mean64 = local_mean.to(torch.float64)
    sums = torch.cat([mean64 * n, (y * y).sum(dims).to(torch.float64) + n * mean64 * mean64])
    if count is None:
        sums = torch.cat([sums.new_full((1,), n), sums])
    sums = group.allreduce_(sums)
    if count is None:
        count, sums = float(sums[0]), sums[1:]
    mean64 = sums[:channels] / count
    var = (sums[channels:] / count - mean64 * mean64).clamp_(min=0.0).to(x.dtype)
    mean = mean64.to(x.dtype)
    y.sub_((mean - local_mean).view(shape))
    return mean, var, count, y


class GroupBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with statistics over the whole group's batch. Like torch's
    kernel it keeps only its input (and per-channel statistics) for the backward, which
    reduces the two per-channel gradient sums over the group (SyncBatchNorm's
    adjoint), each rank's scaled by its ``share`` of the loss (1: every rank's gradient
    is of the same loss, as a spatial group's); the weight and bias gradients stay per
    rank (the fit's allreduce sums them, weighted)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, eps, count=None, share=1.0):  # type: ignore[no-untyped-def]
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean, var, count, y = group_moments(x, group, dims, shape, count)
        invstd = torch.rsqrt(var + eps)
        y.mul_(invstd.view(shape))
        if weight is not None:
            y.mul_(weight.view(shape)).add_(bias.view(shape))
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group, ctx.count, ctx.share = group, count, share
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var, count

    @staticmethod
    def backward(ctx, grad, _mean, _var, _count):  # type: ignore[no-untyped-def]
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        sum_g, sum_gx = grad.sum(dims), (grad * xhat).sum(dims)
        share = ctx.share
        totals = torch.cat([sum_g, sum_gx])
        totals = ctx.group.allreduce_(totals if share == 1.0 else totals * share)
        channels = sum_g.numel()
        # the group's means, in this rank's own scale (a rank without samples has no
        # input gradient to scale: its share is 0)
        own = ctx.count * (share if share > 0 else 1.0)
        mean_g = (totals[:channels] / own).view(shape)
        mean_gx = (totals[channels:] / own).view(shape)
        scale = invstd.view(shape) if weight is None else (weight * invstd).view(shape)
        grad_x = (grad - mean_g - xhat * mean_gx) * scale
        grad_w = sum_gx if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_g if weight is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


@dataclass
class ReplicaGroup:
    """The fit's workers as the layers of one replica's model see them in the running
    step (``rank`` and ``size`` of the fit's process group: under a spatial layout every
    rank of every sample group, ``share`` the group's): set by ``Forward`` before each
    forward (one object shared by every layer)."""

    collective: Any = None
    rank: int = 0
    size: int = 1
    share: float = 1.0  # this replica's b_r / B
    global_batch: int = 0  # B
    # the replica's context: each reduction's wait on the peers adds to its peer_wait_s
    replica: Any = None

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size <= 1:
            return tensor
        started = time.perf_counter()
        reduced = self.collective.allreduce(tensor)
        if self.replica is not None:
            self.replica.peer_wait_s += time.perf_counter() - started
        return reduced


class BatchNormState(nn.Module):
    """A BatchNorm layer's parameters and buffers, the same tensors under the same names
    (so a model whose layers are replaced keeps its ``state_dict``), and its settings."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        self.weight, self.bias = bn.weight, bn.bias
        self.eps, self.momentum = bn.eps, bn.momentum
        self.track_running_stats = bn.track_running_stats
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(bn, name))


class ReplicaBatchNorm(BatchNormState):
    """A BatchNorm layer (any of 1-3 d) whose batch statistics are the global batch's:
    reduced over the fit's replicas, exactly for any split, also for a replica with no
    samples in a step (it takes part with none). It holds the original layer's
    parameters and buffers under the same names, so the model's ``state_dict`` is the
    plain model's. One replica, or evaluation (running statistics): the layer's own
    arithmetic, as torch's."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, group: ReplicaGroup) -> None:
        super().__init__(bn)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        factor = self._running_factor()
        if not self.training or group.size <= 1:  # (an evaluation: each replica its own)
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias,
                self.training or self.running_mean is None, factor, self.eps,
            )  # fmt: skip
        count = float(group.global_batch * _cells(x))  # known: no read of the device's
        dtype = x.dtype
        wide = x if dtype in (torch.float32, torch.float64) else x.float()
        y, mean, var, count = GroupBatchNormFunction.apply(
            wide, self.weight, self.bias, group, self.eps, count, group.share
        )
        if self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / max(count - 1.0, 1.0))
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return y.to(dtype)

    def _running_factor(self) -> float:
        """torch's ``_BatchNorm``: count the batch, and the running statistics' weight
        (``momentum``, or the cumulative average's ``1 / batches`` when it is None)."""
        counted = self.track_running_stats and self.num_batches_tracked is not None
        if not (self.training and counted):
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


def _cells(x: torch.Tensor) -> int:
    """Elements per sample and channel of ``x`` (batch first, channels second)."""
    cells = 1
    for n in x.shape[2:]:
        cells *= int(n)
    return cells


def join_batchnorm(model: nn.Module, group: ReplicaGroup) -> int:
    """Every BatchNorm layer of ``model`` that another group already reduces over (a
    spatial layout's) reduces over ``group`` instead; returns how many."""
    joined = 0
    for layer in model.modules():
        if hasattr(layer, "replicas") and isinstance(layer, BatchNormState):
            layer.replicas = group
            joined += 1
    return joined


def replica_batchnorm(model: nn.Module, group: ReplicaGroup) -> int:
    """Every BatchNorm layer of ``model`` replaced, in place, by a
    :class:`ReplicaBatchNorm` over ``group``; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(parent, name, ReplicaBatchNorm(child, group))
                replaced += 1
    return replaced
