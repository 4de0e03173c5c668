"""LARS and LAMB steps (``ops/layerwise.py``) as kernels over flat buffers.

A layer-wise step scales each parameter tensor's update by a *trust ratio* computed
from norms of that tensor alone, so unlike SGD or AdamW it is not one elementwise pass:

1. per-tensor float64 sums of squares (LARS: of the weights and the gradient; LAMB: of
   the weights and the Adam direction, while the moments are updated in the same pass),
   one work item per chunk of at most a few thousand elements, summed per tensor;
2. one ratio per tensor (a tiny loop over the tensors), written in the buffer's dtype;
3. the elementwise update, each chunk reading its tensor's ratio.

So a step reads the buffers twice and launches three kernels on CUDA (two on the CPU),
however many tensors the buffer holds; a per-tensor torch loop launches several
kernels per tensor (ResNet-50 has 161). The chunk table (``segment, start, length``
rows, from :func:`dataflow.ops.flat.chunk_table`) and which tensors adapt are fixed
for a flat buffer, so the optimizer builds them once. The CUDA kernels are in
``ops/layerwise_cuda.py``; ``ops/layerwise.py`` registers both as ops.

The arithmetic of the update is torch's, in the same order as the references below
(``add(.., alpha=)`` as one FMA on the CPU, as in ``optim_kernels``); the norms are
summed in another order than ``torch.linalg.vector_norm``, so a ratio can differ from
the reference's in its last bit, and results agree to rounding, not bit for bit. LAMB's
CPU moments pass may be reassociated by LLVM (``fastmath={"reassoc"}``): without it its
float64 sums keep the loop from vectorising, and the step took 65 ms on ResNet-50's
parameters on 2 cores against 21 ms with it (torch's per-tensor LAMB: 60 ms).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numba import float64, njit, prange

from dataflow.ops.optim_kernels import adamw_scalars, fma

# -- the ratios (shared by the CPU kernels; the CUDA ones compute them in a kernel) ----


def lars_ratio(w_sq: float, g_sq: float, coefficient: float, weight_decay: float, eps: float):
    """LARS's trust ratio from a tensor's squared weight and gradient norms (float64):
    ``coefficient * |w| / (|g| + weight_decay * |w| + eps)``, 1 where either norm is 0."""
    w, g = math.sqrt(w_sq), math.sqrt(g_sq)
    if w > 0.0 and g > 0.0:
        return coefficient * w / (g + weight_decay * w + eps)
    return 1.0


def lamb_ratio(w_sq: float, u_sq: float) -> float:
    """LAMB's trust ratio ``|w| / |u|`` (``u``: the Adam direction plus weight decay),
    1 where either norm is 0."""
    w, u = math.sqrt(w_sq), math.sqrt(u_sq)
    return w / u if w > 0.0 and u > 0.0 else 1.0


_lars_ratio_jit = njit(cache=True)(lars_ratio)
_lamb_ratio_jit = njit(cache=True)(lamb_ratio)


def lamb_scalars(
    dtype: Any, *, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> dict[str, Any]:
    """LAMB's per-step constants at ``step`` (1-based), in the order its kernels take
    them: AdamW's (``optim_kernels.adamw_scalars``: torch's two-sided ``lerp``, scalars
    cast to ``dtype`` as torch casts them) and the first moment's bias correction
    ``bc1`` and the weight decay ``wd``, which LAMB applies apart from the LR."""
    t = np.dtype(dtype).type
    adamw = adamw_scalars(
        dtype, lr=0.0, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0, step=step
    )
    return {
        "lerp_w": adamw["lerp_w"],
        "lerp_from_end": adamw["lerp_from_end"],
        "beta2": adamw["beta2"],
        "w2": adamw["w2"],
        "bc1": t(1 - beta1**step),
        "bc2_sqrt": adamw["bc2_sqrt"],
        "eps": adamw["eps"],
        "wd": t(weight_decay),
    }


# -- CPU kernels ---------------------------------------------------------------------------


@njit(cache=True)
def _segment_sums(partial, bounds, out):
    """``out[s] = partial[c]`` summed over tensor ``s``'s chunks ``c`` (two columns)."""
    for s in range(bounds.size - 1):
        sx = 0.0
        sy = 0.0
        for c in range(bounds[s], bounds[s + 1]):
            sx += partial[c, 0]
            sy += partial[c, 1]
        out[s, 0] = sx
        out[s, 1] = sy


@njit(parallel=True, cache=True, fastmath={"reassoc"})
def _pair_sums(a, b, table, bounds, out):
    """``out[s] = (sum a^2, sum b^2)`` over tensor ``s``'s chunks, in float64."""
    partial = np.empty((table.shape[0], 2), dtype=np.float64)
    for c in prange(table.shape[0]):
        start, n = table[c, 1], table[c, 2]
        x, y = a[start : start + n], b[start : start + n]
        sx = 0.0
        sy = 0.0
        for k in range(n):
            u, w = float64(x[k]), float64(y[k])
            sx += u * u
            sy += w * w
        partial[c, 0] = sx
        partial[c, 1] = sy
    _segment_sums(partial, bounds, out)


@njit(cache=True)
def _lars_factors(sums, adapt, coefficient, weight_decay, eps, factor):
    for s in range(factor.size):
        factor[s] = (
            _lars_ratio_jit(sums[s, 0], sums[s, 1], coefficient, weight_decay, eps)
            if adapt[s]
            else 1.0
        )


@functools.cache
def _lars_cpu_kernel(momentum: bool, nesterov: bool) -> Any:
    @njit(parallel=True, cache=True)
    def kernel(p, g, m, table, factor, adapt, neg_lr, wd, mu, damp1, first):
        for c in prange(table.shape[0]):
            s, start, n = table[c, 0], table[c, 1], table[c, 2]
            r, decay = factor[s], adapt[s] != 0
            x, gg, mm = p[start : start + n], g[start : start + n], m[start : start + n]
            for k in range(n):
                d = gg[k]
                if decay:
                    d = fma(x[k], wd, d) * r  # grad.add(param, alpha=wd).mul(ratio)
                if momentum:
                    b = d if first else fma(d, damp1, mm[k] * mu)
                    mm[k] = b
                    d = fma(b, mu, d) if nesterov else b
                x[k] = fma(d, neg_lr, x[k])  # param.add_(d, alpha=-lr)

    return kernel


def lars_cpu(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    table: np.ndarray,
    bounds: np.ndarray,
    adapt: np.ndarray,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    trust_coefficient: float,
    eps: float,
    first: bool,
) -> None:
    """One LARS step over the tensors of flat ``p`` (gradient ``g``, momentum ``m``)
    laid out by ``table``/``bounds``; ``adapt[s]``: tensor ``s`` takes the trust ratio
    and the weight decay (else a plain SGD step). ``m`` is unread without momentum."""
    sums = np.empty((bounds.size - 1, 2), dtype=np.float64)
    _pair_sums(p, g, table, bounds, sums)
    factor = np.empty(bounds.size - 1, dtype=p.dtype)
    _lars_factors(sums, adapt, trust_coefficient, weight_decay, eps, factor)
    t = p.dtype.type
    kernel = _lars_cpu_kernel(momentum != 0, nesterov)
    kernel(
        p, g, m, table, factor, adapt, t(-lr), t(weight_decay), t(momentum), t(1 - dampening), first
    )


@functools.cache
def _lamb_cpu_kernels(lerp_from_end: bool) -> Any:
    @njit(inline="always")
    def direction(x, mi, vi, decay, bc1, bc2_sqrt, eps, wd):
        u = (mi / bc1) / (math.sqrt(vi) / bc2_sqrt + eps)
        return fma(x, wd, u) if decay else u  # .add(param, alpha=wd)

    @njit(parallel=True, cache=True, fastmath={"reassoc"})
    def moments(p, g, m, v, table, bounds, adapt, lerp_w, beta2, w2, bc1, bc2_sqrt, eps, wd, out):
        partial = np.empty((table.shape[0], 2), dtype=np.float64)
        for c in prange(table.shape[0]):
            s, start, n = table[c, 0], table[c, 1], table[c, 2]
            decay = adapt[s] != 0
            x, gg = p[start : start + n], g[start : start + n]
            mm, vv = m[start : start + n], v[start : start + n]
            sx = 0.0
            su = 0.0
            for k in range(n):
                gi = gg[k]
                mi = fma(lerp_w, gi - mm[k], gi if lerp_from_end else mm[k])
                vi = fma(w2 * gi, gi, vv[k] * beta2)
                mm[k] = mi
                vv[k] = vi
                u = direction(x[k], mi, vi, decay, bc1, bc2_sqrt, eps, wd)
                sx += float64(x[k]) * float64(x[k])
                su += float64(u) * float64(u)
            partial[c, 0] = sx
            partial[c, 1] = su
        _segment_sums(partial, bounds, out)

    @njit(parallel=True, cache=True)
    def update(p, m, v, table, adapt, factor, bc1, bc2_sqrt, eps, wd):
        for c in prange(table.shape[0]):
            s, start, n = table[c, 0], table[c, 1], table[c, 2]
            decay, step = adapt[s] != 0, factor[s]
            x, mm, vv = p[start : start + n], m[start : start + n], v[start : start + n]
            for k in range(n):
                u = direction(x[k], mm[k], vv[k], decay, bc1, bc2_sqrt, eps, wd)
                x[k] = fma(u, step, x[k])  # param.add_(u, alpha=-lr * ratio)

    return moments, update


@njit(cache=True)
def _lamb_factors(sums, adapt, neg_lr, factor):
    for s in range(factor.size):
        factor[s] = neg_lr * (_lamb_ratio_jit(sums[s, 0], sums[s, 1]) if adapt[s] else 1.0)


def lamb_cpu(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    table: np.ndarray,
    bounds: np.ndarray,
    adapt: np.ndarray,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One LAMB step at ``step`` (1-based) over flat ``p`` with gradient ``g`` and
    moments ``m``, ``v``; ``adapt[s]``: tensor ``s`` takes the trust ratio and the
    weight decay (else a plain Adam step)."""
    s = lamb_scalars(
        p.dtype, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step
    )
    moments, update = _lamb_cpu_kernels(s.pop("lerp_from_end"))
    sums = np.empty((bounds.size - 1, 2), dtype=np.float64)
    moments(p, g, m, v, table, bounds, adapt, *s.values(), sums)
    factor = np.empty(bounds.size - 1, dtype=p.dtype)
    _lamb_factors(sums, adapt, -float(lr), factor)
    update(p, m, v, table, adapt, factor, s["bc1"], s["bc2_sqrt"], s["eps"], s["wd"])


# -- references: per tensor, in torch ----------------------------------------------------


def _sq(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2


def lars_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    bufs: Sequence[torch.Tensor],
    adapt: Sequence[bool],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    trust_coefficient: float,
    eps: float,
    first: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LARS (You et al. 2017) on each tensor, as torch code: the new ``(params, bufs)``.

    ``d = (g + wd * w) * ratio`` for an adapted tensor (else ``g``), then torch's SGD
    momentum and step on ``d``."""
    new_p, new_m = [], []
    for p, g, m, a in zip(params, grads, bufs, adapt, strict=True):
        d = g
        if a:
            ratio = lars_ratio(_sq(p), _sq(g), trust_coefficient, weight_decay, eps)
            d = g.add(p, alpha=weight_decay).mul(ratio)
        if momentum:
            m = d.clone() if first else m.mul(momentum).add(d, alpha=1 - dampening)
            d = d.add(m, alpha=momentum) if nesterov else m
        new_p.append(p.add(d, alpha=-lr))
        new_m.append(m)
    return new_p, new_m


def lamb_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    adapt: Sequence[bool],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """LAMB (You et al. 2019, with Adam's bias correction) on each tensor, as torch
    code: the new ``(params, exp_avgs, exp_avg_sqs)``.

    ``u = m_hat / (sqrt(v_hat) + eps) + wd * w`` (no decay for a tensor that does not
    adapt), ``w -= lr * ratio * u`` with ``ratio = |w| / |u|``."""
    bc1, bc2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
    out: tuple[list, list, list] = ([], [], [])
    for p, g, m, v, a in zip(params, grads, exp_avgs, exp_avg_sqs, adapt, strict=True):
        m = m.lerp(g, 1 - beta1)
        v = v.mul(beta2).addcmul(g, g, value=1 - beta2)
        u = m.div(bc1).div(v.sqrt().div(bc2_sqrt).add(eps))
        if a:
            u = u.add(p, alpha=weight_decay)
        ratio = lamb_ratio(_sq(p), _sq(u)) if a else 1.0
        for dest, value in zip(out, (p.add(u, alpha=-(lr * ratio)), m, v), strict=True):
            dest.append(value)
    return out
