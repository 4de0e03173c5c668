"""Raw kernels of the data-path ops (``ops/transforms.py``) on flat C-contiguous arrays.

Each op has a CPU entry here (numpy arrays in, ``numba.njit(parallel=True)`` kernel).
Log1p and Standardize also have a CUDA entry in ``ops/transform_cuda.py`` (numba device
arrays and ``stream=``, kernel built on first use, so CPU users never import
numba-cuda); the names below forward to it. RandomFlip and RandomRotate90 run torch
code on CUDA (``ops/transform_torch.py``). The kernels write the output dtype directly:
the cast is fused.

Arithmetic runs in float32, or float64 when the input or the output is float64
(:func:`compute_dtype`), and is rounded once to the output dtype (a float64 value meant
for float16 goes through float32, as torch's own cast does).

float16 on the CPU: numba has no float16 arithmetic there, so float16 arrays reach the
kernels as their uint16 bits and are converted by LLVM's half<->float instructions
(:func:`load`, :func:`store`). In a CPU kernel a uint16 array therefore always means
float16; a copy between equal dtypes moves raw bits through signed-integer views.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from dataflow.ops.registry import match_torch_threads

HALF_BITS = np.dtype(np.uint16)  # how a float16 array reaches a CPU kernel
_RAW = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}  # bit-copy views by item size
_ROW_BLOCK = 4096  # elements per parallel work item of Standardize
_ROWS = 16  # rows of the innermost axis per parallel work item of RandomFlip
_TILE = 16  # side of the square tiles RandomRotate90 transposes through


def compute_dtype(x: np.dtype, out: np.dtype) -> np.dtype:
    """float64 when either side is float64, else float32 (float16 is widened)."""
    wide = np.dtype(np.float64) in (np.dtype(x), np.dtype(out))
    return np.dtype(np.float64 if wide else np.float32)


# -- bit-level helpers (CPU) -----------------------------------------------------------


@intrinsic
def _as_bits(typingctx: Any, x: Any) -> Any:
    """The bits of a float32/float64 as int32/int64 (vectorisable, unlike frexp)."""
    width = {types.float32: 32, types.float64: 64}.get(x)
    if width is None:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(width))

    return getattr(types, f"int{width}")(x), codegen


@intrinsic
def _from_bits(typingctx: Any, x: Any) -> Any:
    ret = {
        types.int32: (types.float32, ir.FloatType()),
        types.int64: (types.float64, ir.DoubleType()),
    }
    if x not in ret:
        return None
    nbtype, lltype = ret[x]

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], lltype)

    return nbtype(x), codegen


@intrinsic
def _half_to_float(typingctx: Any, bits: Any) -> Any:
    if bits != types.uint16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _float_to_half(typingctx: Any, value: Any) -> Any:
    if value != types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(value), codegen


# The stubs, overloads and implementations below stay unannotated: numba requires the
# overload's signature to equal its implementation's, annotations included.


def load(a, i):
    """``a[i]``, widened to float32 when ``a`` holds float16 bits (jit only)."""
    raise NotImplementedError


def store(a, i, value):
    """``a[i] = value`` cast to ``a``'s dtype, float16 bits included (jit only)."""
    raise NotImplementedError


def to_type(value, like):
    """``value`` converted to the type of ``like`` (numba promotes int32*float32 to f64)."""
    raise NotImplementedError


@overload(load)
def _load(a, i):
    # Unsigned indices: numba wraps negative signed ones around (Python semantics), a
    # select per element that turns contiguous loads into gathers (about 10x slower).
    if a.dtype == types.uint16:
        return lambda a, i: _half_to_float(a[np.uint64(i)])
    return lambda a, i: a[np.uint64(i)]


@overload(store)
def _store(a, i, value):
    if a.dtype == types.uint16:

        def store_half(a, i, value):
            a[np.uint64(i)] = _float_to_half(np.float32(value))

        return store_half

    def store_plain(a, i, value):
        a[np.uint64(i)] = value

    return store_plain


@overload(to_type)
def _to_type(value, like):
    nbtype = like
    return lambda value, like: nbtype(value)


# -- log1p without branches (musl's log1pf/log1p), so LLVM vectorises it -----------------

_F1, _F2, _FH = np.float32(1), np.float32(2), np.float32(0.5)
_F_LN2_HI, _F_LN2_LO = np.float32(6.9313812256e-01), np.float32(9.0580006145e-06)
_F_LG = tuple(np.float32(c) for c in (0.66666662693, 0.40000972152, 0.28498786688, 0.24279078841))
_F_TINY = np.float32(2.0**-24)
_D_LN2_HI, _D_LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_D_LG = (
    6.666666666666735130e-01,
    3.999999999940941908e-01,
    2.857142874366239149e-01,
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)
_D_TINY = 2.0**-53


@njit(error_model="numpy")  # IEEE division: x/0 is inf, not an exception
def _special(x: Any, r: Any, tiny: Any) -> Any:
    """log1p at the edges: exact for tiny |x| and +inf, -inf at -1, nan below -1 and for nan."""
    r = x if abs(x) < tiny or x == np.inf else r
    r = to_type(-np.inf, x) if x == -1 else r
    return to_type(np.nan, x) if (x < -1 or x != x) else r


@njit(error_model="numpy")
def _log1p32(x: Any) -> Any:
    u = _F1 + x
    iu = np.int64(_as_bits(u)) + (0x3F800000 - 0x3F3504F3)
    k = (iu >> 23) - 0x7F
    c = (_F1 - (u - x)) if k >= 2 else (x - (u - _F1))  # the rounding error of 1 + x
    c = c / u if k < 25 else np.float32(0)
    f = _from_bits(np.int32((iu & 0x007FFFFF) + 0x3F3504F3)) - _F1  # u reduced to [√½, √2)
    s = f / (_F2 + f)
    z = s * s
    w = z * z
    big = z * (_F_LG[0] + w * _F_LG[2]) + w * (_F_LG[1] + w * _F_LG[3])
    hfsq = _FH * f * f
    dk = np.float32(k)
    r = s * (hfsq + big) + (dk * _F_LN2_LO + c) - hfsq + f + dk * _F_LN2_HI
    return _special(x, r, _F_TINY)


@njit(error_model="numpy")
def _log1p64(x: Any) -> Any:
    u = 1.0 + x
    bits = _as_bits(u)
    hu = (bits >> 32) + (0x3FF00000 - 0x3FE6A09E)
    k = (hu >> 20) - 0x3FF
    c = (1.0 - (u - x)) if k >= 2 else (x - (u - 1.0))
    c = c / u if k < 54 else 0.0
    f = _from_bits(np.int64((((hu & 0x000FFFFF) + 0x3FE6A09E) << 32) | (bits & 0xFFFFFFFF))) - 1.0
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (_D_LG[1] + w * (_D_LG[3] + w * _D_LG[5]))
    t2 = z * (_D_LG[0] + w * (_D_LG[2] + w * (_D_LG[4] + w * _D_LG[6])))
    hfsq = 0.5 * f * f
    dk = np.float64(k)
    r = s * (hfsq + t2 + t1) + (dk * _D_LN2_LO + c) - hfsq + f + dk * _D_LN2_HI
    return _special(x, r, _D_TINY)


def fast_log1p(x):
    """log1p within an ulp of libm's, branch-free (jit only; float32 or float64)."""
    raise NotImplementedError


@overload(fast_log1p)
def _fast_log1p(x):
    if x == types.float32:
        return lambda x: _log1p32(x)
    if x == types.float64:
        return lambda x: _log1p64(x)
    return None


# -- CPU kernels -----------------------------------------------------------------------


def _parallel(fn: Any) -> Any:
    """``njit(parallel=True)``, cached on disk where the package folder (or numba's user
    cache) is writable: each Dask worker process would otherwise compile every kernel
    again (about a second per kernel and dtype)."""
    try:
        return njit(parallel=True, error_model="numpy", cache=True)(fn)
    except RuntimeError:  # numba found no writable cache location
        return njit(parallel=True, error_model="numpy")(fn)


@_parallel
def _log1p_cpu(x: Any, out: Any, scale: Any) -> None:
    for i in prange(x.size):
        store(out, i, fast_log1p(to_type(load(x, i), scale) * scale))


@_parallel
def _standardize_cpu(x: Any, out: Any, mean: Any, std: Any, inner: int) -> None:
    channels = mean.size
    rows = x.size // inner
    per_row = (inner + _ROW_BLOCK - 1) // _ROW_BLOCK  # rows split, so N*C = 1 still fans out
    for t in prange(rows * per_row):
        row = t // per_row
        start = row * inner + (t - row * per_row) * _ROW_BLOCK
        stop = min(start + _ROW_BLOCK, (row + 1) * inner)
        m = mean[row % channels]
        s = std[row % channels]
        for i in range(start, stop):
            store(out, i, (to_type(load(x, i), m) - m) / s)


@_parallel
def _flip_cpu(x: Any, out: Any, flags: Any, channels: int, d: int, h: int, w: int) -> None:
    stripes = (h + _ROWS - 1) // _ROWS
    for t in prange(x.size // (h * w) * stripes):  # _ROWS rows of one [h, w] plane each
        plane = t // stripes  # over (n, c, d)
        n = plane // d // channels
        sd = plane % d
        sd = d - 1 - sd if flags[n, 0] else sd
        src_plane = (plane - plane % d + sd) * h * w
        flip_h, flip_w = flags[n, 1], flags[n, 2]
        first = (t % stripes) * _ROWS
        for i in range(first, min(first + _ROWS, h)):
            src = src_plane + (h - 1 - i if flip_h else i) * w
            dst = (plane * h + i) * w
            if flip_w:  # branch per row, not per element
                last = src + w - 1
                for j in range(w):
                    store(out, dst + j, load(x, last - j))
            else:
                for j in range(w):
                    store(out, dst + j, load(x, src + j))


@njit(error_model="numpy")
def _rot_source(k: int, i: int, j: int, side: int) -> tuple[int, int]:
    """Where ``torch.rot90(., k, (a, b))`` takes output ``[i, j]`` from, in the (a, b) plane."""
    if k == 1:
        return j, side - 1 - i
    if k == 2:
        return side - 1 - i, side - 1 - j
    if k == 3:
        return side - 1 - j, i
    return i, j


@_parallel
def _rot90_rows_cpu(x: Any, out: Any, ks: Any, channels: int, dims: Any) -> None:
    """Plane axes above the innermost one: whole rows of the last ``r`` axis are copied."""
    nc_, l_, p, m_, q, r = dims
    for t in prange(nc_ * l_ * p):
        nc = t // (l_ * p)
        plane = (t // p) * p * m_ * q  # offset of [nc, l, 0, 0, 0] in rows of r
        i = t % p
        k = ks[nc // channels]
        for m in range(m_):
            for j in range(q):
                si, sj = _rot_source(k, i, j, p)
                src = (plane + (si * m_ + m) * q + sj) * r
                dst = (plane + (i * m_ + m) * q + j) * r
                for e in range(r):
                    store(out, dst + e, load(x, src + e))


@_parallel
def _rot90_last_cpu(x: Any, out: Any, ks: Any, channels: int, dims: Any) -> None:
    """Plane ending at the innermost axis: copy, reverse, or a tiled transpose per k."""
    nc_, l_, p, m_, q, _ = dims
    stripes = (p + _TILE - 1) // _TILE
    pitch = m_ * q  # distance between consecutive i
    for t in prange(nc_ * l_ * m_ * stripes):
        stripe = t % stripes
        m = (t // stripes) % m_
        block = t // (stripes * m_)  # index over (nc, l)
        k = ks[block // l_ // channels]
        base = block * p * pitch + m * q
        i0 = stripe * _TILE
        i1 = min(i0 + _TILE, p)
        if k == 0:
            for i in range(i0, i1):
                row = base + i * pitch
                for j in range(q):
                    store(out, row + j, load(x, row + j))
        elif k == 2:
            for i in range(i0, i1):
                dst = base + i * pitch
                src = base + (p - 1 - i) * pitch + q - 1
                for j in range(q):
                    store(out, dst + j, load(x, src - j))
        else:
            for j0 in range(0, q, _TILE):
                j1 = min(j0 + _TILE, q)
                for i in range(i0, i1):
                    dst = base + i * pitch
                    if k == 1:  # out[i, j] = x[j, side-1-i]
                        src = base + p - 1 - i
                        for j in range(j0, j1):
                            store(out, dst + j, load(x, src + j * pitch))
                    else:  # out[i, j] = x[side-1-j, i]
                        src = base + (p - 1) * pitch + i
                        for j in range(j0, j1):
                            store(out, dst + j, load(x, src - j * pitch))


# -- CPU entries (what the registry calls with numpy arrays) ---------------------------


def _cpu_view(a: np.ndarray) -> np.ndarray:
    a = a.reshape(-1)
    return a.view(HALF_BITS) if a.dtype == np.float16 else a


def _copy_views(x: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw-bit views for a same-dtype copy, else the kernels' usual views."""
    if x.dtype == out.dtype:
        raw = _RAW[x.dtype.itemsize]
        return x.reshape(-1).view(raw), out.reshape(-1).view(raw)
    return _cpu_view(x), _cpu_view(out)


def log1p_cpu(x: np.ndarray, out: np.ndarray, *, scale: float) -> None:
    match_torch_threads(x.size)
    ct = compute_dtype(x.dtype, out.dtype)
    _log1p_cpu(_cpu_view(x), _cpu_view(out), ct.type(scale))


def standardize_cpu(x: np.ndarray, out: np.ndarray, *, mean: Any, std: Any) -> None:
    match_torch_threads(x.size)
    ct = compute_dtype(x.dtype, out.dtype)
    inner = math.prod(x.shape[2:])
    if x.size:
        m, s = np.asarray(mean, dtype=ct), np.asarray(std, dtype=ct)
        _standardize_cpu(_cpu_view(x), _cpu_view(out), m, s, inner)


def flip_cpu(x: np.ndarray, out: np.ndarray, *, flags: np.ndarray) -> None:
    """``x`` as [N, C, D, H, W]; ``flags[n]``: flip D, H, W of sample n (uint8 0/1)."""
    match_torch_threads(x.size)
    if x.size:
        xf, of = _copy_views(x, out)
        _flip_cpu(xf, of, np.ascontiguousarray(flags, dtype=np.uint8), *x.shape[1:])


def rot90_cpu(x: np.ndarray, out: np.ndarray, *, ks: np.ndarray) -> None:
    """``x`` as [N, C, L, P, M, Q, R], rotated in the (P, Q) plane by ``ks[n]`` quarter turns."""
    match_torch_threads(x.size)
    if x.size:
        xf, of = _copy_views(x, out)
        n, c, *rest = x.shape
        dims = np.array([n * c, *rest], dtype=np.int64)
        kernel = _rot90_last_cpu if rest[-1] == 1 else _rot90_rows_cpu
        kernel(xf, of, np.ascontiguousarray(ks, dtype=np.int64), c, dims)


# -- CUDA entries: in ops/transform_cuda.py, imported on first CUDA use ----------------


def _cuda() -> Any:
    from dataflow.ops import transform_cuda

    return transform_cuda


def log1p_cuda(*arrays: Any, **params: Any) -> None:
    _cuda().log1p_cuda(*arrays, **params)


def standardize_cuda(*arrays: Any, **params: Any) -> None:
    _cuda().standardize_cuda(*arrays, **params)
