"""Gradient-path ops on flat buffers: pack with a scale, and per-buffer sums of squares.

They exist so that the engine touches gradients in one pass and one launch, whatever the
number of tensors: the allreduce packs a bucket with its ``b_r / B`` weight in one
kernel on a GPU (:func:`pack_scaled_`), and every squared gradient norm the engine needs
(the noise-scale estimate, the non-finite check) comes from one launch of
:func:`sum_of_squares` (:func:`grad_squared_norm` sums it).

Many tensors, one kernel: the sources are read through an *arena*, a 1-D view of the
address range that spans them all (built from their addresses with the array
interface), plus a table of where each source starts in it. Kernels only touch the
sources' own elements; the gaps between them are never read. One compiled kernel serves
any number of tensors, and under the CUDA simulator an ordinary array is the arena.

On CUDA, ``pack_scaled_`` keeps its Numba kernel and ``sum_of_squares`` runs torch's
multi-tensor norm with a float64 result. Against torch on an H100
(``benchmarks/bench_gpu.py``, ResNet-50's 161 gradients, torch time / ours, device time
only) ``pack_scaled_`` was at par: 0.80, 0.97, 0.88, 1.15, 1.37, 0.64 against
``torch._foreach_mul`` + ``cat`` (ours needs no second bucket of scaled copies and no
fill for gradients that are None). ``sum_of_squares`` was 0.86, 1.40, 0.78, 0.85, 1.82,
0.78 against ``torch._foreach_norm``; what decided it is host time: a Numba launch
(dispatch, array views, the plan) took a fifth of a one-GPU fit's host step in the
non-finite check, and the fit ran at 0.50x the bf16 hand loop with it, 0.80-0.85x
without (2026-11-26). The Numba CUDA kernel stays for the parity tests.

Dtypes float32 and float64, one dtype per call; scale factors are applied in that
dtype, as ``torch.mul`` with a Python scalar does. Inputs that are only read may be
non-contiguous (they are copied first); outputs written in place must be contiguous.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numba import float64, njit, prange

from dataflow.ops.registry import (
    MAX_BLOCKS,
    THREADS,
    Op,
    OpError,
    as_arrays,
    check,
    cuda_threads,
    device_tables,
    grid_stride,
    one_dtype,
    register,
    run_kernel,
)

CPU_CHUNK = 1 << 14  # elements per parallel work item of the many-tensor CPU kernels
CUDA_CHUNK = 1 << 13  # elements per CUDA block of the many-tensor kernels
PLAN_CACHE = 16  # sum_of_squares plans kept for buffers seen again (the reducer's)


# -- arenas and chunk tables -----------------------------------------------------------


class _HostSpan:
    """Numpy's array interface for ``n`` items of ``dtype`` starting at address ``base``."""

    def __init__(self, base: int, n: int, dtype: np.dtype) -> None:
        self.__array_interface__ = {
            "data": (base, False),
            "shape": (n,),
            "typestr": dtype.str,
            "version": 3,
        }


def _arena(tensors: Sequence[torch.Tensor]) -> tuple[Any, np.ndarray, list[torch.Tensor]]:
    """A 1-D array over the address range of ``tensors`` and each one's start in it.

    Non-contiguous tensors are copied first; the copies are returned with the arena and
    must outlive the kernel. Empty tensors get start 0 (they are never read).
    """
    keep = [t if t.is_contiguous() else t.detach().contiguous() for t in tensors]
    item = keep[0].element_size()
    ptrs = np.array([t.data_ptr() for t in keep], dtype=np.int64)
    sizes = np.array([t.numel() for t in keep], dtype=np.int64)
    live = sizes > 0
    starts, rest = np.divmod(ptrs - (ptrs[live].min() if live.any() else 0), item)
    if rest[live].any():  # misaligned (a reinterpreted byte view): an aligned copy is exact
        return _arena([t.clone() if r else t for t, r in zip(keep, rest, strict=True)])
    starts[~live] = 0
    n = int((starts + sizes)[live].max()) if live.any() else 0
    base = int(ptrs[live].min()) if live.any() else 0
    dtype = np.dtype(torch.empty(0, dtype=keep[0].dtype).numpy().dtype)
    if keep[0].device.type == "cpu":
        arena = np.asarray(_HostSpan(base, n, dtype)) if n else np.empty(0, dtype)
    else:
        from numba import cuda

        desc = {"data": (base, False), "shape": (n,), "typestr": dtype.str, "version": 3}
        arena = (
            cuda.from_cuda_array_interface(desc, owner=None, sync=False)
            if n
            else cuda.device_array(0, dtype)
        )
    return arena, starts, keep


def chunk_table(
    lengths: Sequence[int], src: Sequence[int], dst: Sequence[int], chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split segments into work items of at most ``chunk`` elements.

    Returns ``table`` (rows ``segment, source start, destination start, length``; a
    source start of -1 means "no source, write zeros") and ``bounds`` (segment ``s``
    owns rows ``bounds[s]:bounds[s + 1]``). Equal-sized items keep threads balanced when
    tensor sizes differ by orders of magnitude.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    counts = -(-lengths // chunk)
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    seg = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    offset = (np.arange(bounds[-1], dtype=np.int64) - bounds[seg]) * chunk
    table = np.empty((bounds[-1], 4), dtype=np.int64)
    table[:, 0] = seg
    table[:, 1] = np.where(src[seg] < 0, -1, src[seg] + offset)
    table[:, 2] = dst[seg] + offset
    table[:, 3] = np.minimum(chunk, lengths[seg] - offset)
    return table, bounds


def _number(op: Op, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise OpError(f"{op.name}: {name} must be a real number, got {value!r}")
    return float(value)


def _device(array: Any, stream: Any) -> Any:
    """A small host table (numpy) as a device array; device arrays pass through."""
    from numba import cuda

    return cuda.to_device(array, stream=stream) if isinstance(array, np.ndarray) else array


# -- CPU kernels -----------------------------------------------------------------------


# Inner loops run over slices (views) from index 0: with a plain ``range(lo, hi)`` over
# the big array numba must allow for negative indices, and LLVM does not vectorise them.


@njit(parallel=True, cache=True)
def _pack_kernel(out, arena, table, factor):
    for c in prange(table.shape[0]):
        src, dst, n = table[c, 1], table[c, 2], table[c, 3]
        o = out[dst : dst + n]
        if src < 0:
            o[:] = 0
        else:
            x = arena[src : src + n]
            for k in range(n):
                o[k] = x[k] * factor


# reassoc: lets LLVM vectorise the float64 sum (the order within a chunk is then fixed
# by the build, not sequential; results are still deterministic run to run).
@njit(parallel=True, cache=True, fastmath={"reassoc"})
def _sum_of_squares_kernel(arena, table, bounds, out):
    partial = np.empty(table.shape[0], dtype=np.float64)
    for c in prange(table.shape[0]):
        src, n = table[c, 1], table[c, 3]
        x = arena[src : src + n]
        acc = 0.0
        for k in range(n):
            v = float64(x[k])
            acc += v * v
        partial[c] = acc
    for s in range(out.size):
        acc = 0.0
        for c in range(bounds[s], bounds[s + 1]):
            acc += partial[c]
        out[s] = acc


# -- CUDA kernels (compiled on first CUDA use) -----------------------------------------


cuda: Any = None  # numba.cuda, bound on first CUDA use (see _cuda_kernels)


@functools.cache
def _cuda_kernels() -> Any:
    """Compile nothing yet (cuda.jit is lazy) but import numba-cuda, once.

    ``cuda`` is bound as a module global, not a local: the simulator swaps the module
    in a kernel's globals for its fake one, and would miss a closure variable.
    """
    global cuda
    from numba import cuda

    @cuda.jit
    def pack(out, arena, table, factor):
        for c in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
            src, dst, n = table[c, 1], table[c, 2], table[c, 3]
            for k in range(cuda.threadIdx.x, n, cuda.blockDim.x):
                if src < 0:
                    out[dst + k] = 0
                else:
                    out[dst + k] = arena[src + k] * factor

    @cuda.jit
    def segment_sums(partial, bounds, out):
        for s in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            acc = 0.0
            for c in range(bounds[s], bounds[s + 1]):
                acc += partial[c]
            out[s] = acc

    return locals()


@functools.cache
def _squares_kernel(threads: int) -> Any:
    """Per-chunk float64 sums of squares, a block of ``threads`` (a power of 2) per chunk."""
    _cuda_kernels()

    @cuda.jit
    def squares(arena, table, partial):
        shared = cuda.shared.array(threads, dtype=np.float64)
        tid = cuda.threadIdx.x
        for c in range(cuda.blockIdx.x, table.shape[0], cuda.gridDim.x):
            src, n = table[c, 1], table[c, 3]
            acc = 0.0
            for k in range(tid, n, threads):
                x = float64(arena[src + k])
                acc += x * x
            shared[tid] = acc
            cuda.syncthreads()
            half = threads // 2
            while half > 0:
                if tid < half:
                    shared[tid] += shared[tid + half]
                cuda.syncthreads()
                half //= 2
            if tid == 0:
                partial[c] = shared[0]
            cuda.syncthreads()

    return squares


# -- kernel entries: (cpu, cuda) per op --------------------------------------------------


def _pack_cpu(out: np.ndarray, arena: np.ndarray, table: np.ndarray, *, factor: float) -> None:
    _pack_kernel(out, arena, table, out.dtype.type(factor))


def _pack_cuda(out: Any, arena: Any, table: Any, *, stream: Any, factor: float) -> None:
    longest = int(table[:, 3].max()) if isinstance(table, np.ndarray) and table.size else THREADS
    grid = (min(max(table.shape[0], 1), MAX_BLOCKS), cuda_threads(longest), stream)
    _cuda_kernels()["pack"][grid](out, arena, _device(table, stream), out.dtype.type(factor))


def _sum_of_squares_cpu(arena: np.ndarray, table: np.ndarray, bounds: np.ndarray, out: Any) -> None:
    _sum_of_squares_kernel(arena, table, bounds, out)


def _sum_of_squares_cuda(
    arena: Any, table: Any, bounds: Any, out: Any, *, stream: Any, partial: Any = None
) -> None:
    """``partial``: float64 scratch, one per table row (allocated here when not given)."""
    from numba import cuda

    longest = int(table[:, 3].max()) if isinstance(table, np.ndarray) and table.size else THREADS
    threads = min(THREADS, 1 << max(5, (longest - 1).bit_length()))  # a power of 2 >= 32
    if partial is None:
        partial = cuda.device_array(max(table.shape[0], 1), dtype=np.float64, stream=stream)
    grid = (min(max(table.shape[0], 1), MAX_BLOCKS), threads, stream)
    _squares_kernel(threads)[grid](arena, _device(table, stream), partial)
    segment_sums = _cuda_kernels()["segment_sums"]
    segment_sums[grid_stride(out.size, stream)](partial, _device(bounds, stream), out)


# -- references: the plain torch definitions the kernels are tested against --------------


def _pack_reference(
    tensors: Sequence[torch.Tensor | None], *, factor: float, sizes: Sequence[int]
) -> torch.Tensor:
    like = next(t for t in tensors if t is not None)
    parts = [
        t.reshape(-1) * factor if t is not None else like.new_zeros(n)
        for t, n in zip(tensors, sizes, strict=True)
    ]
    return torch.cat(parts)


def _sum_of_squares_reference(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([b.double().pow(2).sum() for b in buffers])


PACK_SCALED = register(Op("pack_scaled_", _pack_cpu, _pack_cuda, _pack_reference))
SUM_OF_SQUARES = register(
    Op("sum_of_squares", _sum_of_squares_cpu, _sum_of_squares_cuda, _sum_of_squares_reference)
)
# -- the functions users call ------------------------------------------------------------


def pack_scaled_(
    out: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    factor: float = 1.0,
    *,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Copy ``tensors`` one after another into the flat ``out``, times ``factor``.

    One launch for a whole allreduce bucket: ``out[o_i : o_i + n_i] = factor *
    tensors[i].reshape(-1)``, the reducer's "pack scaled by ``b_r / B``". A ``None``
    entry (a parameter that got no gradient) writes zeros; its size comes from
    ``sizes``, each tensor's element count, required when any entry is ``None``.
    ``out`` is contiguous with exactly the total element count. Returns ``out``.
    """
    tensors = list(tensors)
    factor = _number(PACK_SCALED, "factor", factor)
    present = [t for t in tensors if t is not None]
    device = check(PACK_SCALED, [out, *present], inplace=(0,))
    one_dtype(PACK_SCALED, [out, *present])
    lengths = _sizes(tensors, sizes)
    if sum(lengths) != out.numel():
        raise OpError(
            f"pack_scaled_: the tensors hold {sum(lengths)} elements but out has "
            f"{out.numel()}; out must be exactly as large as the tensors together"
        )
    if out.numel() == 0:
        return out
    if present:
        arena, starts, keep = _arena(present)
    else:
        arena, starts, keep = _arena([out[:0]])
    src = np.full(len(tensors), -1, dtype=np.int64)
    src[[i for i, t in enumerate(tensors) if t is not None]] = starts[: len(present)]
    dst = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])
    chunk = CPU_CHUNK if device.type == "cpu" else CUDA_CHUNK
    table, _ = chunk_table(lengths, src, dst, chunk)
    (flat,) = as_arrays([out.view(-1)], device)
    run_kernel(PACK_SCALED, device, out.numel(), flat, arena, table, factor=factor)
    del keep
    return out


def _sizes(tensors: Sequence[torch.Tensor | None], sizes: Sequence[int] | None) -> list[int]:
    if sizes is None:
        missing = [i for i, t in enumerate(tensors) if t is None]
        if missing:
            raise OpError(
                f"pack_scaled_: tensors{missing} are None; pass sizes=[numel per tensor] so "
                "their zero-filled segments have a length"
            )
        return [t.numel() for t in tensors]
    sizes = [int(n) for n in sizes]
    if len(sizes) != len(tensors) or any(n < 0 for n in sizes):
        raise OpError(
            f"pack_scaled_: sizes must hold one element count >= 0 per tensor; got "
            f"{len(sizes)} sizes for {len(tensors)} tensors"
        )
    for i, (t, n) in enumerate(zip(tensors, sizes, strict=True)):
        if t is not None and t.numel() != n:
            raise OpError(f"pack_scaled_: tensors[{i}] has {t.numel()} elements, sizes[{i}]={n}")
    return sizes


def sum_of_squares(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each buffer's sum of squared elements, accumulated in float64, in one launch.

    Returns a float64 tensor of ``len(buffers)`` on the buffers' device, without waiting
    for it (no host sync): the squared gradient norms the noise-scale estimate and the
    non-finite check need (``.sqrt()`` gives the norms). Buffers seen again at the same
    addresses (the reducer's flat buckets, every step) reuse their launch plan.
    """
    buffers = list(buffers)
    if not buffers:
        raise OpError("sum_of_squares: got no buffers; pass at least one tensor")
    device = check(SUM_OF_SQUARES, buffers)
    one_dtype(SUM_OF_SQUARES, buffers)
    if device.type == "cuda":
        return _sum_of_squares_torch(buffers)
    return _sum_of_squares_numba(buffers, device)


def _sum_of_squares_torch(buffers: list[torch.Tensor]) -> torch.Tensor:
    """On CUDA, torch's multi-tensor norm with a float64 result. The Numba kernel lost
    to it on an H100 in device time (0.61 against 0.48 ms on ResNet-50's gradients) and
    costs far more host time per call (dispatch, array views, the plan): in a one-GPU
    fit the non-finite check alone took a fifth of the host's step time."""
    return torch.stack(torch._foreach_norm(buffers, 2, dtype=torch.float64)).square()


def _sum_of_squares_numba(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The Numba kernels (CPU; CUDA kept for parity tests and the kernel benchmark)."""
    out = torch.zeros(len(buffers), dtype=torch.float64, device=device)
    arena, table, bounds, keep = _squares_plan(buffers, device)
    (flat_out,) = as_arrays([out], device)
    work = sum(b.numel() for b in buffers)
    if device.type == "cuda":
        partial = torch.empty(max(table.shape[0], 1), dtype=torch.float64, device=device)
        scratch = as_arrays([partial], device)[0]
        args = (arena, table, bounds, flat_out)
        run_kernel(SUM_OF_SQUARES, device, work, *args, partial=scratch)
    else:
        run_kernel(SUM_OF_SQUARES, device, work, arena, table, bounds, flat_out)
    del keep  # copies of non-contiguous buffers lived until the kernel was queued
    return out


_PLANS: dict[tuple, tuple] = {}


def _squares_plan(buffers: list[torch.Tensor], device: torch.device) -> tuple:
    """``(arena, table, bounds, keep)`` for :func:`sum_of_squares`, tables ready for
    ``device``. Cached by address when the arena spans the buffers themselves (no
    copies): the same addresses, sizes and dtype give the same plan."""
    key = (
        str(device),
        buffers[0].dtype,
        tuple(b.data_ptr() for b in buffers),
        tuple(b.numel() for b in buffers),
    )
    contiguous = all(b.is_contiguous() for b in buffers)
    if contiguous and key in _PLANS:
        return _PLANS[key]
    arena, starts, keep = _arena(buffers)
    chunk = CPU_CHUNK if device.type == "cpu" else CUDA_CHUNK
    lengths = [b.numel() for b in buffers]
    table, bounds = chunk_table(lengths, starts, np.zeros(len(buffers), np.int64), chunk)
    table, bounds = device_tables([table, bounds], device)
    if not contiguous or any(k is not b for k, b in zip(keep, buffers, strict=True)):
        return arena, table, bounds, keep  # over copies: valid for this call only
    plan = (arena, table, bounds, [])
    if len(_PLANS) >= PLAN_CACHE:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan
    return plan


def grad_squared_norm(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``sum_i |tensors[i]|^2`` (``None`` entries skipped) as a 0-d float64 tensor on the
    tensors' device, accumulated in float64, in one launch and without a host sync.

    The one gradient-norm routine of the engine: the reducer's local and reduced norms,
    the noise-scale pairs and Update's non-finite check all use it. A NaN or inf
    anywhere makes it non-finite. No tensors: a CPU zero.
    """
    present = [t for t in tensors if t is not None and t.numel()]
    if not present:
        return torch.zeros((), dtype=torch.float64)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in present:
        groups.setdefault((t.device, t.dtype), []).append(t.detach())
    sums = [sum_of_squares(group).sum() for group in groups.values()]
    return sums[0] if len(sums) == 1 else torch.stack([s.cpu() for s in sums]).sum()
