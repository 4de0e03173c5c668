"""CUDA kernels of the data-path ops (``ops/transforms.py``), built on first use so CPU
users never import numba-cuda; ``ops/transform_kernels.py`` holds the CPU kernels and
the rules they share (:func:`~dataflow.ops.transform_kernels.compute_dtype`).

Log1p and Standardize only: RandomFlip and RandomRotate90 run torch code on CUDA
(``ops/transform_torch.py``, which says why).

Each entry takes numba device arrays (flat C-contiguous) and ``stream=``, and writes the
output dtype directly: the cast is fused.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numba
import numpy as np

from dataflow.ops.registry import blocks
from dataflow.ops.transform_kernels import compute_dtype

_MAX_BLOCKS = 1 << 16  # CUDA grid cap; kernels loop grid-stride over the rest


# -- CUDA kernels (built on first use) -------------------------------------------------


cuda: Any = None  # numba.cuda, bound by _import_cuda() on first CUDA use


def _import_cuda() -> Any:
    """Import numba.cuda and bind it as this module's global ``cuda`` for the kernels.

    A global, not a closure variable: the CUDA simulator swaps a kernel's globals that
    are ``numba.cuda`` for its fake module, and would miss a closure's.
    """
    global cuda
    from numba import cuda as module

    cuda = module
    return module


def _nb(dtype: np.dtype) -> Any:
    return numba.from_dtype(np.dtype(dtype))


def _final_type(x: np.dtype, out: np.dtype) -> Any:
    """The type a value passes through before the store: float32 next to float16."""
    half = np.dtype(np.float16)
    if np.dtype(out) == half or (np.dtype(x) == half and np.dtype(x) != np.dtype(out)):
        return numba.float32
    return _nb(out)


@functools.cache
def _cuda_log1p(ct: Any, final: Any) -> Any:
    _import_cuda()

    @cuda.jit
    def kernel(x: Any, out: Any, scale: Any) -> None:
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = final(math.log1p(ct(x[i]) * scale))

    return kernel


@functools.cache
def _cuda_standardize(ct: Any, final: Any) -> Any:
    _import_cuda()

    @cuda.jit
    def kernel(x: Any, out: Any, mean: Any, std: Any, inner: int) -> None:
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            c = (i // inner) % mean.size
            out[i] = final((ct(x[i]) - mean[c]) / std[c])

    return kernel


def _flat(a: Any) -> Any:
    return a.reshape(a.size)


def _device(a: Any, dtype: Any, stream: Any) -> Any:
    """Host data (the per-channel statistics) copied on ``stream``."""
    return _import_cuda().to_device(np.ascontiguousarray(a, dtype=dtype), stream=stream)


def _config(n: int, stream: Any) -> tuple[int, int, Any]:
    """Launch configuration: capped grid (the kernels loop grid-stride), threads, stream."""
    count, threads = blocks(n)
    return min(count, _MAX_BLOCKS), threads, stream


def log1p_cuda(x: Any, out: Any, *, scale: float, stream: Any = 0) -> None:
    ct = compute_dtype(x.dtype, out.dtype)
    kernel = _cuda_log1p(_nb(ct), _final_type(ct, out.dtype))
    kernel[_config(x.size, stream)](_flat(x), _flat(out), ct.type(scale))


def standardize_cuda(x: Any, out: Any, *, mean: Any, std: Any, stream: Any = 0) -> None:
    ct = compute_dtype(x.dtype, out.dtype)
    if x.size:
        m = _device(mean, ct, stream)
        s = _device(std, ct, stream)
        kernel = _cuda_standardize(_nb(ct), _final_type(ct, out.dtype))
        inner = math.prod(x.shape[2:])
        kernel[_config(x.size, stream)](_flat(x), _flat(out), m, s, inner)
