"""The flat-buffer ops' CPU kernels against their plain torch definitions.

Shapes, lengths and dtypes come from hypothesis; inputs that are only read are also
given non-contiguous (transposed, strided), outputs written in place must be contiguous.
"""

from __future__ import annotations

import warnings

import numba
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow.ops import flat, halo
from dataflow.ops.registry import PARALLEL_MIN, OpError

DTYPES = (torch.float32, torch.float64)
# Relative tolerances per dtype for results that are sums of several rounded terms.
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
SETTINGS = settings(deadline=None, max_examples=25)

dtypes = st.sampled_from(DTYPES)
factors = st.floats(-4, 4, allow_nan=False, allow_infinity=False)


def tensor(shape, dtype, seed, *, contiguous=True) -> torch.Tensor:
    """A random tensor; non-contiguous ones are strided views of a larger buffer."""
    g = torch.Generator().manual_seed(seed)
    if contiguous or len(shape) == 0:
        return torch.randn(shape, dtype=dtype, generator=g)
    big = torch.randn((*shape[:-1], 2 * shape[-1] + 1), dtype=dtype, generator=g)
    view = big[..., 1::2]
    assert view.shape == tuple(shape)
    return view


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


# -- pack_scaled_ -------------------------------------------------------------------------


@SETTINGS
@given(
    parts=st.lists(st.tuples(shapes, st.booleans(), st.booleans()), min_size=1, max_size=6),
    dtype=dtypes,
    factor=factors,
    chunk=st.sampled_from([3, 8, flat.CPU_CHUNK]),
    seed=st.integers(0, 99),
)
def test_pack_scaled_matches_cat_of_scaled_tensors(parts, dtype, factor, chunk, seed):
    """``(shape, contiguous, present)`` per tensor; absent ones are zero-filled."""
    tensors = [
        tensor(shape, dtype, seed + i, contiguous=c) if present else None
        for i, (shape, c, present) in enumerate(parts)
    ]
    sizes = [torch.Size(shape).numel() for shape, _, _ in parts]
    out = torch.full((sum(sizes),), float("nan"), dtype=dtype)
    original, flat.CPU_CHUNK = flat.CPU_CHUNK, chunk  # small chunks: many work items
    try:
        flat.pack_scaled_(out, tensors, factor, sizes=sizes)
    finally:
        flat.CPU_CHUNK = original
    if any(t is not None for t in tensors):
        expected = flat.PACK_SCALED.reference(tensors, factor=factor, sizes=sizes)
    else:
        expected = torch.zeros(sum(sizes), dtype=dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_pack_scaled_reads_views_that_share_storage_in_any_order():
    """The arena spans sources wherever they live, overlapping views of one storage too."""
    base = torch.randn(1000, dtype=torch.float64)
    tensors = [base[500:700].view(10, 20), base[:300], torch.randn(7, dtype=torch.float64)]
    tensors.append(base[100:150])  # overlaps base[:300]
    out = torch.empty(200 + 300 + 7 + 50, dtype=torch.float64)
    flat.pack_scaled_(out, tensors, 0.5)
    torch.testing.assert_close(out, torch.cat([t.reshape(-1) * 0.5 for t in tensors]))


def test_a_misaligned_source_is_read_correctly():
    """A float32 tensor at an odd byte address (here, over a bytearray) is copied first."""
    buffer = bytearray(4 * 10 + 1)
    with warnings.catch_warnings():  # torch warns that the bytearray is not read-only
        warnings.simplefilter("ignore")
        odd = torch.frombuffer(buffer, dtype=torch.float32, offset=1, count=10)
    odd.copy_(torch.arange(10.0))
    assert odd.data_ptr() % 4 != 0
    out = torch.empty(13)
    flat.pack_scaled_(out, [torch.ones(3), odd], 2.0)
    torch.testing.assert_close(out, torch.cat([torch.ones(3), torch.arange(10.0)]) * 2)


def test_pack_scaled_names_its_bad_input():
    g = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(OpError, match="hold 7 elements but out has 8"):
        flat.pack_scaled_(torch.zeros(8), g)
    with pytest.raises(OpError, match=r"tensors\[1\] are None; pass sizes="):
        flat.pack_scaled_(torch.zeros(7), [g[0], None])
    with pytest.raises(OpError, match=r"tensors\[1\] has 4 elements, sizes\[1\]=5"):
        flat.pack_scaled_(torch.zeros(8), g, sizes=[3, 5])
    with pytest.raises(OpError, match="factor must be a real number"):
        flat.pack_scaled_(torch.zeros(7), g, "2")
    with pytest.raises(OpError, match="pack_scaled_: argument 0 is written in place"):
        flat.pack_scaled_(torch.zeros(14)[::2], g)


# -- sum_of_squares -----------------------------------------------------------------------


@SETTINGS
@given(
    parts=st.lists(st.tuples(shapes, st.booleans()), min_size=1, max_size=6),
    dtype=dtypes,
    chunk=st.sampled_from([5, flat.CPU_CHUNK]),
    seed=st.integers(0, 99),
)
def test_sum_of_squares_matches_float64_reference(parts, dtype, chunk, seed):
    buffers = [tensor(s, dtype, seed + i, contiguous=c) for i, (s, c) in enumerate(parts)]
    original, flat.CPU_CHUNK = flat.CPU_CHUNK, chunk
    try:
        got = flat.sum_of_squares(buffers)
    finally:
        flat.CPU_CHUNK = original
    assert got.dtype == torch.float64 and got.shape == (len(buffers),)
    expected = flat.SUM_OF_SQUARES.reference(buffers)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_sum_of_squares_accumulates_float32_in_float64():
    """2**24 + 1000 is not a float32: a float32 accumulator would return 2**24."""
    x = torch.ones(1001, dtype=torch.float32)
    x[0] = 4096.0
    assert flat.sum_of_squares([x]).item() == 2.0**24 + 1000


def test_sum_of_squares_over_many_chunks_of_a_large_buffer():
    x = torch.randn(3 * flat.CPU_CHUNK + 17, dtype=torch.float32)
    got = flat.sum_of_squares([x, x[:5]])
    torch.testing.assert_close(got, flat.SUM_OF_SQUARES.reference([x, x[:5]]), rtol=1e-12, atol=0)


def test_pack_scaled_refuses_a_non_contiguous_out():
    out = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(OpError, match=r"pack_scaled_: argument 0 is written in place and must"):
        flat.pack_scaled_(out, [torch.ones(12)], 2.0)


def test_sum_of_squares_reuses_its_plan_only_for_the_same_contiguous_buffers():
    base = torch.randn(40, dtype=torch.float64)
    first = flat.sum_of_squares([base[:10], base[20:30]])
    base.mul_(2.0)  # same addresses, new values: the cached plan reads them
    again = flat.sum_of_squares([base[:10], base[20:30]])
    torch.testing.assert_close(again, 4 * first, rtol=1e-12, atol=0)
    strided = base[:20:2]  # the address and size of base[:10], other elements
    got = flat.sum_of_squares([strided, base[20:30]])
    torch.testing.assert_close(got, flat.SUM_OF_SQUARES.reference([strided, base[20:30]]))


def test_grad_squared_norm_sums_the_present_tensors_in_float64():
    grads = [torch.randn(3, 4), None, torch.randn(7), torch.zeros(0)]
    expected = sum(g.double().pow(2).sum() for g in grads if g is not None)
    got = flat.grad_squared_norm(grads)
    assert got.dtype == torch.float64 and got.ndim == 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    assert flat.grad_squared_norm([None]).item() == 0.0
    assert not torch.isfinite(flat.grad_squared_norm([torch.tensor([1.0, float("inf")])]))


# -- halo ---------------------------------------------------------------------------------


@st.composite
def halo_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=2, max_size=5)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[axis]
    width = draw(st.integers(1, size))
    offset = draw(st.integers(0, size - width))
    return shape, axis, width, offset, draw(st.sampled_from(halo.SIDES))


@SETTINGS
@given(case=halo_cases(), dtype=dtypes, transposed=st.booleans(), seed=st.integers(0, 99))
def test_pack_and_unpack_halo_match_narrow(case, dtype, transposed, seed):
    shape, axis, width, offset, side = case
    x = tensor(shape, dtype, seed)
    if transposed:  # a non-contiguous x with the same shape
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    start = offset if side == "low" else x.shape[axis] - offset - width
    slab = halo.pack_halo(x, axis, width, side, offset=offset)
    assert slab.is_contiguous()
    expected = halo.PACK_HALO.reference(x, axis=axis, start=start, width=width)
    torch.testing.assert_close(slab, expected, rtol=0, atol=0)

    target = torch.zeros(shape, dtype=dtype)
    halo.unpack_halo_(target, slab * 2, axis, width, side, offset=offset)
    expected = halo.UNPACK_HALO.reference(
        torch.zeros_like(target), slab * 2, axis=axis, start=start
    )
    torch.testing.assert_close(target, expected, rtol=0, atol=0)


def test_halo_names_its_bad_input():
    x = torch.zeros(2, 3, 4, 5, 6)
    with pytest.raises(OpError, match="axis=5 is not an axis of a 5-d tensor"):
        halo.pack_halo(x, 5, 1, "low")
    with pytest.raises(OpError, match="width=0 must be an integer >= 1"):
        halo.pack_halo(x, 2, 0, "low")
    with pytest.raises(OpError, match="offset \\+ width = 5 exceeds the tensor's size 4"):
        halo.pack_halo(x, 2, 2, "high", offset=3)
    with pytest.raises(OpError, match="side='left' must be 'low' or 'high'"):
        halo.pack_halo(x, 2, 1, "left")
    with pytest.raises(OpError, match=r"slab has shape \(2, 3, 1, 5, 6\), expected \(2, 3, 2"):
        halo.unpack_halo_(x, torch.zeros(2, 3, 1, 5, 6), 2, 2, "low")
    with pytest.raises(OpError, match="unpack_halo_: argument 0 is written in place"):
        halo.unpack_halo_(x.transpose(0, 1), torch.zeros(3, 2, 1, 5, 6), 2, 1, "low")
    with pytest.raises(OpError, match="one dtype, got float32, float64"):
        halo.unpack_halo_(x, torch.zeros(2, 3, 1, 5, 6, dtype=torch.float64), 2, 1, "low")


# -- dtype and device policy --------------------------------------------------------------

CALLS = {
    "pack_scaled_": lambda t: flat.pack_scaled_(t, [t], 1.0),
    "sum_of_squares": lambda t: flat.sum_of_squares([t]),
    "pack_halo": lambda t: halo.pack_halo(t, 0, 1, "low"),
    "unpack_halo_": lambda t: halo.unpack_halo_(t, t[:1].clone(), 0, 1, "low"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32, torch.int64])
def test_unsupported_dtypes_are_refused_by_name(name, dtype):
    t = torch.zeros(4, 3, dtype=dtype)
    message = f"{name}: dtype {dtype} is not supported; supported: dtypes float32, float64"
    with pytest.raises(OpError, match=message):
        CALLS[name](t)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_unsupported_devices_are_refused_by_name(name):
    t = torch.zeros(4, 3, device="meta")
    with pytest.raises(OpError, match=f"{name}: device meta is not supported; supported:"):
        CALLS[name](t)


def test_mixed_dtypes_are_refused():
    with pytest.raises(OpError, match="pack_scaled_: all tensors must have one dtype"):
        flat.pack_scaled_(torch.zeros(3), [torch.zeros(3, dtype=torch.float64)])


def test_cpu_kernels_use_torchs_thread_budget_and_one_thread_when_small():
    """A replica limits torch's threads to its share of the node; numba must follow.
    Small inputs run on one thread (waking others costs more than it saves)."""
    before = torch.get_num_threads()
    big = torch.ones(PARALLEL_MIN)
    try:
        torch.set_num_threads(1)
        flat.sum_of_squares([big])
        assert numba.get_num_threads() == 1
        torch.set_num_threads(before)
        flat.pack_scaled_(big, [big], 2.0)
        assert numba.get_num_threads() == min(before, numba.config.NUMBA_NUM_THREADS)
        flat.pack_scaled_(big[:10], [big[:10]], 2.0)
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
