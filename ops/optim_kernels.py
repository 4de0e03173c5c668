"""The fused optimizer updates (``ops/optim.py``) as kernels over flat buffers.

One elementwise pass per step: every parameter of a flat buffer is read and written
once, however many tensors it holds. The arithmetic is torch's own, in the same order
and rounding (``torch.optim.SGD`` / ``AdamW``, single-tensor path): scalars are cast to
the buffer's dtype first, and where torch fuses a multiply-add (``add(.., alpha=)``,
``lerp``, ``addcmul``) the CPU kernel calls ``llvm.fma`` (:func:`fma`), so float32 SGD
matches torch bit for bit. The AdamW CUDA kernel writes ``a * b + c``, which NVVM
contracts to an FMA as nvcc does for torch's kernels.

SGD has no Numba CUDA kernel: on CUDA it is torch's fused SGD over the flat buffer
(:func:`sgd_torch`, the op's ``torch_cuda``). The Numba kernel it had lost to
``torch.optim.SGD(fused=True)`` on an H100 (``benchmarks/bench_gpu.py``, ResNet-50's
parameters, torch time / ours: 0.80, 0.85, 0.59 on 2026-11-26; 1.20, 0.80 on 11-24).
AdamW keeps its kernel: at par with or ahead of ``AdamW(fused=True)`` (1.06, 1.47,
1.00; 1.05, 0.69 on 11-24).

The options that change the loop (nesterov, maximize, ...) are compile-time constants:
each combination is its own kernel, built once and cached on disk.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic

from dataflow.ops.registry import Op, blocks, match_torch_threads, register

THREADS = 256  # CUDA threads per block
MAX_BLOCKS = 1 << 14  # CUDA grid cap; kernels loop grid-stride over the rest


@intrinsic
def fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` rounded once (LLVM's fma), for float32 or float64 (jit only)."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fma(*args)

    return a(a, b, c), codegen


# -- SGD --------------------------------------------------------------------------------


@functools.cache
def _sgd_cpu_kernel(momentum: bool, weight_decay: bool, nesterov: bool, maximize: bool) -> Any:
    @njit(parallel=True, cache=True)
    def kernel(p, g, m, neg_lr, wd, mu, damp1, first):
        for i in prange(p.size):
            d = -g[i] if maximize else g[i]
            if weight_decay:
                d = fma(p[i], wd, d)  # grad.add(param, alpha=weight_decay)
            if momentum:
                b = d if first else fma(d, damp1, m[i] * mu)  # buf.mul_(mu).add_(d, alpha=)
                m[i] = b
                d = fma(b, mu, d) if nesterov else b
            p[i] = fma(d, neg_lr, p[i])  # param.add_(d, alpha=-lr)

    return kernel


def sgd_cpu(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    first: bool,
) -> None:
    """One SGD step over flat ``p`` with gradient ``g`` and momentum buffer ``m``.

    ``first``: the momentum buffer is new and becomes the gradient (torch's first step);
    ``m`` is not read when ``momentum == 0`` (any array of the right dtype will do).
    """
    match_torch_threads(p.size)
    t = p.dtype.type
    kernel = _sgd_cpu_kernel(momentum != 0, weight_decay != 0, nesterov, maximize)
    kernel(p, g, m, t(-lr), t(weight_decay), t(momentum), t(1 - dampening), first)


def sgd_reference(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.optim.SGD's update of one tensor: the new ``(p, m)``."""
    d = -g if maximize else g
    if weight_decay:
        d = d.add(p, alpha=weight_decay)
    if momentum:
        m = d.clone() if first else m.mul(momentum).add(d, alpha=1 - dampening)
        d = d.add(m, alpha=momentum) if nesterov else m
    return p.add(d, alpha=-lr), m


def sgd_torch(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    first: bool,
) -> None:
    """:func:`sgd_cpu` on tensors, by torch's fused SGD: what FusedSGD runs on CUDA.

    ``torch._fused_sgd_`` is the kernel of ``torch.optim.SGD(fused=True)``, called here
    on one flat buffer instead of a list of parameters: the same elementwise update, in
    one launch. It does not round the scalars to the buffer's dtype first as the CPU
    kernel does, so the two may differ in the last bit of float32 (both are torch's
    SGD; the CPU kernel is its single-tensor path).
    """
    torch._fused_sgd_(
        [p],
        [g],
        [m] if momentum else [],
        weight_decay=weight_decay,
        momentum=momentum,
        lr=lr,
        dampening=dampening,
        nesterov=nesterov,
        maximize=maximize,
        is_first_step=bool(first and momentum),
    )


# -- AdamW ------------------------------------------------------------------------------


@functools.cache
def _adamw_cpu_kernel(maximize: bool, lerp_from_end: bool) -> Any:
    @njit(parallel=True, cache=True)
    def kernel(p, g, m, v, decay, lerp_w, beta2, w2, bc2_sqrt, eps, neg_step):
        for i in prange(p.size):
            gi = -g[i] if maximize else g[i]
            mi = m[i]
            # exp_avg.lerp_(grad, 1 - beta1), torch's two-sided formula
            mi = fma(lerp_w, gi - mi, gi if lerp_from_end else mi)
            vi = fma(w2 * gi, gi, v[i] * beta2)  # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
            m[i] = mi
            v[i] = vi
            p[i] = p[i] * decay + neg_step * mi / (math.sqrt(vi) / bc2_sqrt + eps)

    return kernel


def adamw_scalars(
    dtype: Any, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> dict[str, Any]:
    """The per-step constants of AdamW at ``step`` (1-based), as torch computes them, in
    float64 and then cast to ``dtype``."""
    t = np.dtype(dtype).type
    w1 = 1 - beta1
    from_end = w1 >= 0.5
    return {
        "decay": t(1 - lr * weight_decay),
        "lerp_w": t(w1) - t(1) if from_end else t(w1),
        "lerp_from_end": from_end,
        "beta2": t(beta2),
        "w2": t(1 - beta2),
        "bc2_sqrt": t((1 - beta2**step) ** 0.5),
        "eps": t(eps),
        "neg_step": t(-(lr / (1 - beta1**step))),
    }


def adamw_cpu(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    maximize: bool,
) -> None:
    """One AdamW step (decoupled weight decay, bias correction at ``step``) over flat
    ``p`` with gradient ``g`` and moments ``m``, ``v``."""
    match_torch_threads(p.size)
    s = adamw_scalars(
        p.dtype, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step
    )
    kernel = _adamw_cpu_kernel(maximize, s.pop("lerp_from_end"))
    kernel(p, g, m, v, *s.values())


def adamw_reference(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    maximize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW's update of one tensor at ``step``: the new ``(p, m, v)``."""
    g = -g if maximize else g
    p = p * (1 - lr * weight_decay)
    m = m.lerp(g, 1 - beta1)
    v = v.mul(beta2).addcmul(g, g, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add(eps)
    return p.addcdiv(m, denom, value=-(lr / (1 - beta1**step))), m, v


# -- CUDA (compiled on first use) ---------------------------------------------------------

cuda: Any = None  # numba.cuda, bound on first CUDA use (the simulator swaps globals only)


def _import_cuda() -> None:
    global cuda
    from numba import cuda


@functools.cache
def _adamw_cuda_kernel(maximize: bool, lerp_from_end: bool) -> Any:
    _import_cuda()

    @cuda.jit
    def kernel(p, g, m, v, decay, lerp_w, beta2, w2, bc2_sqrt, eps, neg_step):
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            gi = -g[i] if maximize else g[i]
            mi = m[i]
            mi = lerp_w * (gi - mi) + (gi if lerp_from_end else mi)
            vi = w2 * gi * gi + v[i] * beta2
            m[i] = mi
            v[i] = vi
            p[i] = p[i] * decay + neg_step * mi / (math.sqrt(vi) / bc2_sqrt + eps)

    return kernel


def _grid(n: int, stream: Any) -> tuple[int, int, Any]:
    """A grid-stride launch over ``n`` elements: warp-multiple blocks of <= THREADS."""
    threads = min(THREADS, max(32, -(-n // 32) * 32))
    return min(blocks(n, threads)[0], MAX_BLOCKS), threads, stream


def adamw_cuda(p: Any, g: Any, m: Any, v: Any, *, stream: Any, **params: Any) -> None:
    """:func:`adamw_cpu` on device arrays, queued on ``stream`` (0 under the simulator)."""
    maximize = params.pop("maximize")
    s = adamw_scalars(p.dtype, **params)
    kernel = _adamw_cuda_kernel(maximize, s.pop("lerp_from_end"))
    kernel[_grid(p.size, stream)](p, g, m, v, *s.values())


SGD_STEP = register(Op("sgd_step", sgd_cpu, None, sgd_reference, torch_cuda=sgd_torch))
ADAMW_STEP = register(Op("adamw_step", adamw_cpu, adamw_cuda, adamw_reference))
