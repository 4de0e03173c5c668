"""Halo slabs: the boundary layer of a tensor along one axis, packed into a contiguous
slab and written back, for the coming spatial decomposition (a replica sends its
boundary slab to its neighbour and receives theirs into its ghost layer).

One op each way (:func:`pack_halo`, :func:`unpack_halo_`): a CPU kernel, a CUDA kernel
and the plain torch reference (``narrow``) both are tested against. Dtypes float32 and
float64; ``x`` is viewed as ``[outer, axis, inner]``, so any shape works.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numba import njit, prange

from dataflow.ops.registry import (
    Op,
    OpError,
    as_arrays,
    check,
    grid_stride,
    launch,
    match_torch_threads,
    one_dtype,
    register,
    run_kernel,
)

HALO_CHUNK = 4096  # elements of one slab row per parallel work item (CPU)
SIDES = ("low", "high")


# -- kernels ---------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _halo_kernel(x, slab, start, to_slab):
    outer, width, inner = slab.shape
    parts = (inner + HALO_CHUNK - 1) // HALO_CHUNK
    for t in prange(outer * width * parts):
        q = t // parts
        part = t - q * parts
        r = q // width
        w = q - r * width
        lo = part * HALO_CHUNK
        hi = min(inner, lo + HALO_CHUNK)
        s = slab[r, w, lo:hi]
        y = x[r, start + w, lo:hi]
        if to_slab:
            for k in range(hi - lo):
                s[k] = y[k]
        else:
            for k in range(hi - lo):
                y[k] = s[k]


cuda: Any = None  # numba.cuda, bound on first CUDA use (see _cuda_halo)


@functools.cache
def _cuda_halo() -> Any:
    """The CUDA kernel, compiled lazily; ``cuda`` is bound as a module global (the
    simulator swaps the module in a kernel's globals for its fake one)."""
    global cuda
    from numba import cuda

    @cuda.jit
    def halo(x, slab, start, to_slab):
        width, inner = slab.shape[1], slab.shape[2]
        for j in range(cuda.grid(1), slab.size, cuda.gridsize(1)):
            q = j // inner
            k = j - q * inner
            r = q // width
            w = q - r * width
            if to_slab:
                slab[r, w, k] = x[r, start + w, k]
            else:
                x[r, start + w, k] = slab[r, w, k]

    return halo


def _as_3d(x: Any, slab: Any, axis: int) -> tuple[Any, Any]:
    shape = tuple(x.shape)
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    return x.reshape(outer, shape[axis], inner), slab.reshape(outer, slab.shape[axis], inner)


def _halo_cpu(to_slab: bool) -> Any:
    def run(x: np.ndarray, slab: np.ndarray, *, axis: int, start: int) -> None:
        match_torch_threads(slab.size)
        x3, slab3 = _as_3d(x, slab, axis)
        _halo_kernel(x3, slab3, start, to_slab)

    return run


def _halo_cuda(to_slab: bool) -> Any:
    def run(x: Any, slab: Any, *, stream: Any, axis: int, start: int) -> None:
        x3, slab3 = _as_3d(x, slab, axis)
        _cuda_halo()[grid_stride(slab3.size, stream)](x3, slab3, start, to_slab)

    return run


# -- references: the plain torch definitions the kernels are tested against ------------


def _pack_halo_reference(x: torch.Tensor, *, axis: int, start: int, width: int) -> torch.Tensor:
    return x.narrow(axis, start, width).contiguous()


def _unpack_halo_reference(
    x: torch.Tensor, slab: torch.Tensor, *, axis: int, start: int
) -> torch.Tensor:
    out = x.clone()
    out.narrow(axis, start, slab.shape[axis]).copy_(slab)
    return out


PACK_HALO = register(Op("pack_halo", _halo_cpu(True), _halo_cuda(True), _pack_halo_reference))
UNPACK_HALO = register(
    Op("unpack_halo_", _halo_cpu(False), _halo_cuda(False), _unpack_halo_reference)
)


# -- the functions users call ------------------------------------------------------------


def _halo_start(
    op: Op, shape: Sequence[int], axis: Any, width: Any, side: Any, offset: Any
) -> tuple[int, int]:
    """Validate a slab's position; return ``(axis, first index along it)``."""
    ndim = len(shape)
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise OpError(f"{op.name}: axis={axis!r} is not an axis of a {ndim}-d tensor")
    axis %= ndim
    for name, value, low in (("width", width, 1), ("offset", offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise OpError(f"{op.name}: {name}={value!r} must be an integer >= {low}")
    if offset + width > shape[axis]:
        raise OpError(
            f"{op.name}: offset + width = {offset + width} exceeds the tensor's size "
            f"{shape[axis]} along axis {axis}; use a smaller width or offset"
        )
    if side not in SIDES:
        raise OpError(f"{op.name}: side={side!r} must be 'low' or 'high'")
    start = offset if side == "low" else shape[axis] - offset - width
    return axis, start


def pack_halo(
    x: torch.Tensor, axis: int, width: int, side: str, *, offset: int = 0
) -> torch.Tensor:
    """The ``width``-thick boundary slab of ``x`` along ``axis`` as a contiguous tensor.

    ``side="low"`` takes indices ``offset : offset + width`` along ``axis``, ``"high"``
    the same counted from the end: what a spatially decomposed replica sends to its
    neighbour (``offset=width`` skips a ghost layer). ``x`` is [N, C, D, H, W], 2-D or
    any shape; a non-contiguous ``x`` is copied first.
    """
    axis, start = _halo_start(PACK_HALO, x.shape, axis, width, side, offset)
    shape = list(x.shape)
    shape[axis] = width
    slab = torch.empty(shape, dtype=x.dtype, device=x.device)
    if slab.numel():
        launch(PACK_HALO, x, slab, inplace=(1,), axis=axis, start=start)
    return slab


def unpack_halo_(
    x: torch.Tensor, slab: torch.Tensor, axis: int, width: int, side: str, *, offset: int = 0
) -> torch.Tensor:
    """Write ``slab`` (from :func:`pack_halo`) back into the same place of ``x``, in place.

    ``x`` must be contiguous; ``slab`` has ``x``'s shape with ``width`` along ``axis``.
    Returns ``x``.
    """
    axis, start = _halo_start(UNPACK_HALO, x.shape, axis, width, side, offset)
    expected = list(x.shape)
    expected[axis] = width
    if list(slab.shape) != expected:
        raise OpError(
            f"unpack_halo_: slab has shape {tuple(slab.shape)}, expected {tuple(expected)} "
            f"(x's shape with width={width} along axis {axis})"
        )
    device = check(UNPACK_HALO, [x, slab], inplace=(0,))
    one_dtype(UNPACK_HALO, [x, slab])
    if slab.numel():
        arrays = as_arrays([x, slab], device)
        run_kernel(UNPACK_HALO, device, slab.numel(), *arrays, axis=axis, start=start)
    return x
