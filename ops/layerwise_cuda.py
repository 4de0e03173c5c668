"""The CUDA kernels of LARS and LAMB (``ops/layerwise_kernels.py`` has the CPU ones, the
references and the plan): per chunk a block reduces the float64 sums of squares in
shared memory, one thread per tensor turns them into its factor, and a grid over the
chunks applies the update, each block reading its chunk's tensor's factor. Three
launches a step on torch's stream; no host read. Compiled on first CUDA use; under
``NUMBA_ENABLE_CUDASIM=1`` they run on Numba's simulator (the parity tests).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from numba import float64

from dataflow.ops.flat import _device
from dataflow.ops.layerwise_kernels import lamb_scalars
from dataflow.ops.registry import MAX_BLOCKS, THREADS, grid_stride

cuda: Any = None  # numba.cuda, bound on first CUDA use (the simulator swaps globals only)


def _import_cuda() -> None:
    global cuda
    from numba import cuda


def _threads(table: Any) -> int:
    """Threads per block: a power of 2 from 32 to THREADS, as long as the longest chunk
    (all of them on the CPU-side table; THREADS when the table lives on the device)."""
    if isinstance(table, np.ndarray) and table.size:
        longest = int(table[:, 2].max())
        return min(THREADS, 1 << max(5, (longest - 1).bit_length()))
    return THREADS


@functools.cache
def _reductions(threads: int) -> Any:
    """The device functions both optimizers' kernels share: a block's two float64 sums
    reduced in shared memory into its chunk's row of ``partial``, and a tensor's sums
    over its chunks' rows."""
    _import_cuda()

    @cuda.jit(device=True)
    def block_pair_sums(a, b, sx, sy, tid, partial, c):
        sx[tid] = a
        sy[tid] = b
        cuda.syncthreads()
        half = threads // 2
        while half > 0:
            if tid < half:
                sx[tid] += sx[tid + half]
                sy[tid] += sy[tid + half]
            cuda.syncthreads()
            half //= 2
        if tid == 0:
            partial[c, 0] = sx[0]
            partial[c, 1] = sy[0]
        cuda.syncthreads()

    @cuda.jit(device=True)
    def segment_pair_sums(partial, bounds, s):
        a = 0.0
        b = 0.0
        for c in range(bounds[s], bounds[s + 1]):
            a += partial[c, 0]
            b += partial[c, 1]
        return a, b

    return block_pair_sums, segment_pair_sums


@functools.cache
def _lars_cuda_kernels(threads: int, momentum: bool, nesterov: bool) -> Any:
    block_pair_sums, segment_pair_sums = _reductions(threads)

    @cuda.jit
    def sums(p, g, table, partial):
        sx = cuda.shared.array(threads, dtype=np.float64)
        sy = cuda.shared.array(threads, dtype=np.float64)
        tid = cuda.threadIdx.x
        for c in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
            start, n = table[c, 1], table[c, 2]
            a = 0.0
            b = 0.0
            for k in range(tid, n, threads):
                u, w = float64(p[start + k]), float64(g[start + k])
                a += u * u
                b += w * w
            block_pair_sums(a, b, sx, sy, tid, partial, c)

    @cuda.jit
    def factors(partial, bounds, adapt, coefficient, weight_decay, eps, factor):
        for s in range(cuda.grid(1), factor.size, cuda.gridsize(1)):
            a, b = segment_pair_sums(partial, bounds, s)
            r = 1.0
            if adapt[s] != 0:
                w, gn = math.sqrt(a), math.sqrt(b)
                if w > 0.0 and gn > 0.0:
                    r = coefficient * w / (gn + weight_decay * w + eps)
            factor[s] = r

    @cuda.jit
    def update(p, g, m, table, factor, adapt, neg_lr, wd, mu, damp1, first):
        for c in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
            s, start, n = table[c, 0], table[c, 1], table[c, 2]
            r, decay = factor[s], adapt[s] != 0
            for k in range(cuda.threadIdx.x, n, cuda.blockDim.x):
                i = start + k
                d = g[i]
                if decay:
                    d = (p[i] * wd + d) * r
                if momentum:
                    b = d if first else d * damp1 + m[i] * mu
                    m[i] = b
                    d = b * mu + d if nesterov else b
                p[i] = d * neg_lr + p[i]

    return sums, factors, update


def _scratch(partial: Any, factor: Any, chunks: int, segments: int, dtype: Any, stream: Any):
    if partial is None:
        partial = cuda.device_array((max(chunks, 1), 2), dtype=np.float64, stream=stream)
    if factor is None:
        factor = cuda.device_array(max(segments, 1), dtype=dtype, stream=stream)
    return partial, factor


def lars_cuda(
    p: Any,
    g: Any,
    m: Any,
    table: Any,
    bounds: Any,
    adapt: Any,
    *,
    stream: Any,
    partial: Any = None,
    factor: Any = None,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    trust_coefficient: float,
    eps: float,
    first: bool,
) -> None:
    """:func:`lars_cpu` on device arrays, queued on ``stream`` (0 under the simulator).
    ``partial`` (float64, chunks x 2) and ``factor`` (one per tensor, the buffer's
    dtype) are scratch, allocated here when not given."""
    _import_cuda()
    threads = _threads(table)
    chunks, segments = table.shape[0], bounds.shape[0] - 1
    partial, factor = _scratch(partial, factor, chunks, segments, p.dtype, stream)
    table, bounds, adapt = (_device(a, stream) for a in (table, bounds, adapt))
    sums, factors, update = _lars_cuda_kernels(threads, momentum != 0, nesterov)
    grid = (min(max(chunks, 1), MAX_BLOCKS), threads, stream)
    sums[grid](p, g, table, partial)
    factors[grid_stride(max(segments, 1), stream)](
        partial, bounds, adapt, trust_coefficient, weight_decay, eps, factor
    )
    t = p.dtype.type
    update[grid](
        p, g, m, table, factor, adapt, t(-lr), t(weight_decay), t(momentum), t(1 - dampening), first
    )


@functools.cache
def _lamb_cuda_kernels(threads: int, lerp_from_end: bool) -> Any:
    block_pair_sums, segment_pair_sums = _reductions(threads)

    @cuda.jit(device=True)
    def direction(x, mi, vi, decay, bc1, bc2_sqrt, eps, wd):
        u = (mi / bc1) / (math.sqrt(vi) / bc2_sqrt + eps)
        return x * wd + u if decay else u

    @cuda.jit
    def moments(p, g, m, v, table, adapt, lerp_w, beta2, w2, bc1, bc2_sqrt, eps, wd, partial):
        sx = cuda.shared.array(threads, dtype=np.float64)
        su = cuda.shared.array(threads, dtype=np.float64)
        tid = cuda.threadIdx.x
        for c in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
            s, start, n = table[c, 0], table[c, 1], table[c, 2]
            decay = adapt[s] != 0
            a = 0.0
            b = 0.0
            for k in range(tid, n, threads):
                i = start + k
                gi = g[i]
                mi = lerp_w * (gi - m[i]) + (gi if lerp_from_end else m[i])
                vi = w2 * gi * gi + v[i] * beta2
                m[i] = mi
                v[i] = vi
                u = direction(p[i], mi, vi, decay, bc1, bc2_sqrt, eps, wd)
                a += float64(p[i]) * float64(p[i])
                b += float64(u) * float64(u)
            block_pair_sums(a, b, sx, su, tid, partial, c)

    @cuda.jit
    def factors(partial, bounds, adapt, neg_lr, factor):
        for s in range(cuda.grid(1), factor.size, cuda.gridsize(1)):
            a, b = segment_pair_sums(partial, bounds, s)
            r = 1.0
            if adapt[s] != 0:
                w, u = math.sqrt(a), math.sqrt(b)
                if w > 0.0 and u > 0.0:
                    r = w / u
            factor[s] = neg_lr * r

    @cuda.jit
    def update(p, m, v, table, adapt, factor, bc1, bc2_sqrt, eps, wd):
        for c in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
            s, start, n = table[c, 0], table[c, 1], table[c, 2]
            decay, step = adapt[s] != 0, factor[s]
            for k in range(cuda.threadIdx.x, n, cuda.blockDim.x):
                i = start + k
                u = direction(p[i], m[i], v[i], decay, bc1, bc2_sqrt, eps, wd)
                p[i] = u * step + p[i]

    return moments, factors, update


def lamb_cuda(
    p: Any,
    g: Any,
    m: Any,
    v: Any,
    table: Any,
    bounds: Any,
    adapt: Any,
    *,
    stream: Any,
    partial: Any = None,
    factor: Any = None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """:func:`lamb_cpu` on device arrays, queued on ``stream`` (scratch as in
    :func:`lars_cuda`)."""
    _import_cuda()
    threads = _threads(table)
    chunks, segments = table.shape[0], bounds.shape[0] - 1
    partial, factor = _scratch(partial, factor, chunks, segments, p.dtype, stream)
    table, bounds, adapt = (_device(a, stream) for a in (table, bounds, adapt))
    s = lamb_scalars(
        p.dtype, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step
    )
    moments, factors, update = _lamb_cuda_kernels(threads, s.pop("lerp_from_end"))
    grid = (min(max(chunks, 1), MAX_BLOCKS), threads, stream)
    moments[grid](p, g, m, v, table, adapt, *s.values(), partial)
    factors[grid_stride(max(segments, 1), stream)](partial, bounds, adapt, -float(lr), factor)
    update[grid](p, m, v, table, adapt, factor, s["bc1"], s["bc2_sqrt"], s["eps"], s["wd"])
