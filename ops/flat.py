"""Gradient-path ops on flat buffers: scale, weighted sum, pack with a scale, per-buffer
sums of squares, and halo slabs.

They exist so that the engine touches gradients in one pass and one launch, whatever the
number of tensors: the allreduce packs a bucket with its ``b_r / B`` weight in one
kernel (:func:`pack_scaled_`), the batch-size tuner gets every gradient's squared norm in
one kernel (:func:`sum_of_squares`).

Many tensors, one kernel: the sources are read through an *arena*, a 1-D view of the
address range that spans them all (built from their addresses with the array
interface), plus a table of where each source starts in it. Kernels only touch the
sources' own elements; the gaps between them are never read. One compiled kernel serves
any number of tensors, and under the CUDA simulator an ordinary array is the arena.

Dtypes float32 and float64, one dtype per call; scale factors and weights are applied in
that dtype, as ``torch.mul`` with a Python scalar does. Inputs that are only read may be
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
    Op,
    OpError,
    as_arrays,
    blocks,
    check,
    launch,
    match_torch_threads,
    register,
    torch_stream,
)

CPU_CHUNK = 1 << 14  # elements per parallel work item of the many-tensor CPU kernels
CUDA_CHUNK = 1 << 13  # elements per CUDA block of the many-tensor kernels
THREADS = 256  # CUDA threads per block
MAX_BLOCKS = 1 << 14  # CUDA grid cap; kernels loop grid-stride over the rest
HALO_CHUNK = 4096  # elements of one slab row per parallel work item (CPU)
SIDES = ("low", "high")


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


def _run(op: Op, device: torch.device, work: int, *arrays: Any, **params: Any) -> Any:
    """Call ``op``'s kernel for ``device`` on ``work`` elements: on the CPU with torch's
    thread budget; on CUDA on torch's current stream, with host tables copied through
    torch's caching allocator (numba's would allocate each call)."""
    if device.type == "cpu":
        match_torch_threads(work)
        return op.cpu(*arrays, **params)
    tables = [torch.from_numpy(a).to(device) if isinstance(a, np.ndarray) else a for a in arrays]
    converted = [as_arrays([t], device)[0] if isinstance(t, torch.Tensor) else t for t in tables]
    return op.cuda(*converted, stream=torch_stream(), **params)


def _one_dtype(op: Op, tensors: Sequence[torch.Tensor]) -> None:
    if len({t.dtype for t in tensors}) > 1:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        raise OpError(
            f"{op.name}: all tensors must have one dtype, got {', '.join(dtypes)}; "
            "convert them with .to(dtype) first"
        )


def _number(op: Op, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise OpError(f"{op.name}: {name} must be a real number, got {value!r}")
    return float(value)


# -- CPU kernels -----------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _scale_kernel(buffer, factor):
    for i in prange(buffer.size):
        buffer[i] = buffer[i] * factor


# Inner loops run over slices (views) from index 0: with a plain ``range(lo, hi)`` over
# the big array numba must allow for negative indices, and LLVM does not vectorise them.


@njit(parallel=True, cache=True)
def _weighted_sum_kernel(out, arena, starts, weights, block):
    # Per block: out = w0 * in0, then out += wi * ini; the block stays in cache between
    # passes. An input aliasing out must be inputs[0] (read before out is written).
    for b in prange((out.size + block - 1) // block):
        lo = b * block
        m = min(out.size - lo, block)
        o = out[lo : lo + m]
        x = arena[starts[0] + lo : starts[0] + lo + m]
        w = weights[0]
        for j in range(m):
            o[j] = w * x[j]
        for i in range(1, starts.size):
            x = arena[starts[i] + lo : starts[i] + lo + m]
            w = weights[i]
            for j in range(m):
                o[j] = o[j] + w * x[j]


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
    def scale(buffer, factor):
        for i in range(cuda.grid(1), buffer.size, cuda.gridsize(1)):
            buffer[i] = buffer[i] * factor

    @cuda.jit
    def weighted_sum(out, arena, starts, weights):
        for j in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            acc = weights[0] * arena[starts[0] + j]
            for i in range(1, starts.size):
                acc = acc + weights[i] * arena[starts[i] + j]
            out[j] = acc

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


def _threads(n: int) -> int:
    """Threads per block for ``n`` work elements: a warp multiple, at most THREADS."""
    return min(THREADS, max(32, -(-n // 32) * 32))


def _grid(n: int, stream: Any) -> tuple[int, int, Any]:
    """A grid-stride launch over ``n`` elements on ``stream``."""
    threads = _threads(n)
    return min(blocks(n, threads)[0], MAX_BLOCKS), threads, stream


def _device(array: Any, stream: Any) -> Any:
    """A small host table (numpy) as a device array; device arrays pass through."""
    from numba import cuda

    return cuda.to_device(array, stream=stream) if isinstance(array, np.ndarray) else array


# -- kernel entries: (cpu, cuda) per op --------------------------------------------------


def _scale_cpu(buffer: np.ndarray, *, factor: float) -> None:
    match_torch_threads(buffer.size)
    _scale_kernel(buffer, buffer.dtype.type(factor))


def _scale_cuda(buffer: Any, *, stream: Any, factor: float) -> None:
    _cuda_kernels()["scale"][_grid(buffer.size, stream)](buffer, buffer.dtype.type(factor))


def _weighted_sum_cpu(out: np.ndarray, arena: np.ndarray, starts: np.ndarray, weights: Any) -> None:
    _weighted_sum_kernel(out, arena, starts, np.asarray(weights, dtype=out.dtype), CPU_CHUNK)


def _weighted_sum_cuda(out: Any, arena: Any, starts: Any, weights: Any, *, stream: Any) -> None:
    if isinstance(weights, list | tuple):
        weights = np.asarray(weights, dtype=out.dtype)
    kernel = _cuda_kernels()["weighted_sum"][_grid(out.size, stream)]
    kernel(out, arena, _device(starts, stream), _device(weights, stream))


def _pack_cpu(out: np.ndarray, arena: np.ndarray, table: np.ndarray, *, factor: float) -> None:
    _pack_kernel(out, arena, table, out.dtype.type(factor))


def _pack_cuda(out: Any, arena: Any, table: Any, *, stream: Any, factor: float) -> None:
    longest = int(table[:, 3].max()) if isinstance(table, np.ndarray) and table.size else THREADS
    grid = (min(max(table.shape[0], 1), MAX_BLOCKS), _threads(longest), stream)
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
    segment_sums[_grid(out.size, stream)](partial, _device(bounds, stream), out)


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
        _cuda_kernels()["halo"][_grid(slab3.size, stream)](x3, slab3, start, to_slab)

    return run


# -- references: the plain torch definitions the kernels are tested against --------------


def _scale_reference(buffer: torch.Tensor, *, factor: float) -> torch.Tensor:
    return buffer * factor


def _weighted_sum_reference(
    inputs: Sequence[torch.Tensor], weights: Sequence[float]
) -> torch.Tensor:
    return sum(w * x.reshape(-1) for w, x in zip(weights, inputs, strict=True))


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


def _pack_halo_reference(x: torch.Tensor, *, axis: int, start: int, width: int) -> torch.Tensor:
    return x.narrow(axis, start, width).contiguous()


def _unpack_halo_reference(
    x: torch.Tensor, slab: torch.Tensor, *, axis: int, start: int
) -> torch.Tensor:
    out = x.clone()
    out.narrow(axis, start, slab.shape[axis]).copy_(slab)
    return out


SCALE = register(Op("scale_", _scale_cpu, _scale_cuda, _scale_reference))
WEIGHTED_SUM = register(
    Op("weighted_sum_", _weighted_sum_cpu, _weighted_sum_cuda, _weighted_sum_reference)
)
PACK_SCALED = register(Op("pack_scaled_", _pack_cpu, _pack_cuda, _pack_reference))
SUM_OF_SQUARES = register(
    Op("sum_of_squares", _sum_of_squares_cpu, _sum_of_squares_cuda, _sum_of_squares_reference)
)
PACK_HALO = register(Op("pack_halo", _halo_cpu(True), _halo_cuda(True), _pack_halo_reference))
UNPACK_HALO = register(
    Op("unpack_halo_", _halo_cpu(False), _halo_cuda(False), _unpack_halo_reference)
)


# -- the functions users call ------------------------------------------------------------


def scale_(buffer: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``buffer`` by ``factor`` in place (it must be contiguous); returns it."""
    factor = _number(SCALE, "factor", factor)
    launch(SCALE, buffer, inplace=(0,), factor=factor)
    return buffer


def weighted_sum_(
    out: torch.Tensor, inputs: Sequence[torch.Tensor], weights: Sequence[float]
) -> torch.Tensor:
    """``out = sum_i weights[i] * inputs[i]`` elementwise, in one pass; returns ``out``.

    The sample-count weighting of an allreduce done on one device: ``weights[i]`` is
    replica ``i``'s share ``b_i / B``. Every input has ``out.numel()`` elements (any
    shape); ``out`` must be contiguous and may be one of the inputs (an input that
    overlaps ``out`` otherwise is copied first).
    """
    inputs, weights = list(inputs), [_number(WEIGHTED_SUM, "weights", w) for w in weights]
    if not inputs or len(inputs) != len(weights):
        raise OpError(
            f"weighted_sum_: got {len(inputs)} inputs and {len(weights)} weights; pass at "
            "least one input and one weight per input"
        )
    device = check(WEIGHTED_SUM, [out, *inputs], inplace=(0,))
    _one_dtype(WEIGHTED_SUM, [out, *inputs])
    for i, x in enumerate(inputs):
        if x.numel() != out.numel():
            raise OpError(
                f"weighted_sum_: inputs[{i}] has {x.numel()} elements but out has "
                f"{out.numel()}; every input must match out's size"
            )
    if out.numel() == 0:
        return out
    inputs, weights = _out_first(out, inputs, weights)
    (flat,) = as_arrays([out.view(-1)], device)
    arena, starts, keep = _arena(inputs)
    dtype = torch.empty(0, dtype=out.dtype).numpy().dtype
    work = out.numel() * len(inputs)
    _run(WEIGHTED_SUM, device, work, flat, arena, starts, np.asarray(weights, dtype=dtype))
    del keep  # the copies of non-contiguous inputs lived until the kernel was queued
    return out


def _out_first(
    out: torch.Tensor, inputs: list[torch.Tensor], weights: list[float]
) -> tuple[list[torch.Tensor], list[float]]:
    """Put the input that is ``out`` itself first (the CPU kernel reads inputs[0] before
    writing out); copy any other input that overlaps ``out``."""
    item = out.element_size()
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * item
    first = None
    safe = []
    for i, x in enumerate(inputs):
        x_lo = x.data_ptr()
        x_hi = x_lo + (x.numel() - 1) * max(x.stride(), default=1) * item + item
        if x_lo < hi and lo < x_hi:
            if first is None and x_lo == lo and x.is_contiguous():
                first = i
            else:
                x = x.clone()
        safe.append(x)
    if first is None:
        return safe, weights
    order = [first, *(i for i in range(len(safe)) if i != first)]
    return [safe[i] for i in order], [weights[i] for i in order]


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
    _one_dtype(PACK_SCALED, [out, *present])
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
    _run(PACK_SCALED, device, out.numel(), flat, arena, table, factor=factor)
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

    Returns a float64 tensor of ``len(buffers)`` on the buffers' device: the squared
    gradient norms the batch-size tuner needs (``.sqrt()`` gives the norms).
    """
    buffers = list(buffers)
    if not buffers:
        raise OpError("sum_of_squares: got no buffers; pass at least one tensor")
    device = check(SUM_OF_SQUARES, buffers)
    _one_dtype(SUM_OF_SQUARES, buffers)
    out = torch.zeros(len(buffers), dtype=torch.float64, device=device)
    arena, starts, keep = _arena(buffers)
    chunk = CPU_CHUNK if device.type == "cpu" else CUDA_CHUNK
    lengths = [b.numel() for b in buffers]
    table, bounds = chunk_table(lengths, starts, np.zeros(len(buffers), np.int64), chunk)
    (flat_out,) = as_arrays([out], device)
    scratch = {}
    if device.type == "cuda":
        partial = torch.empty(max(len(table), 1), dtype=torch.float64, device=device)
        scratch["partial"] = as_arrays([partial], device)[0]
    _run(SUM_OF_SQUARES, device, sum(lengths), arena, table, bounds, flat_out, **scratch)
    del keep
    return out


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
    _one_dtype(UNPACK_HALO, [x, slab])
    if slab.numel():
        arrays = as_arrays([x, slab], device)
        _run(UNPACK_HALO, device, slab.numel(), *arrays, axis=axis, start=start)
    return x
