"""Data-path ops (ops/transforms.py): the CPU kernels against the plain torch references."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.errors import ConfigError
from dataflow.ops import transforms as T
from dataflow.ops.registry import OpError

# (input dtype, dtype=): each pair compiles the kernels once; float16 is read as bits.
CASTS = [(torch.float32, None), (torch.float64, None), (torch.float16, torch.float32)]
# Kernel and reference compute in the same precision and differ only in the libm:
# a few ulp of the output dtype.
TOL = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-7},
    torch.float64: {"rtol": 1e-14, "atol": 1e-15},
    torch.float16: {"rtol": 1e-3, "atol": 1e-4},
}
SETTINGS = settings(max_examples=12, deadline=None)


def out_dtype(dtype_in: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype or dtype_in


def make(shape: tuple[int, ...], dtype: torch.dtype, layout: str, seed: int, low=-0.9, high=9.0):
    """A tensor of ``shape``: contiguous, a transposed view, or a strided slice."""
    rng = np.random.default_rng(seed)
    if layout == "transposed":  # last two axes swapped in memory
        base = rng.uniform(low, high, size=(*shape[:-2], shape[-1], shape[-2]))
        x = torch.from_numpy(base).to(dtype).transpose(-1, -2)
    elif layout == "sliced":  # every other element of a wider last axis
        base = rng.uniform(low, high, size=(*shape[:-1], 2 * shape[-1]))
        x = torch.from_numpy(base).to(dtype)[..., ::2]
    else:
        x = torch.from_numpy(rng.uniform(low, high, size=shape)).to(dtype)
    assert tuple(x.shape) == shape  # (size-1 axes can leave a view contiguous)
    return x


@st.composite
def batches(draw, ndims=(4, 5)):
    ndim = draw(st.sampled_from(ndims))
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    shape += tuple(draw(st.integers(1, 9)) for _ in range(ndim - 2))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if layout == "transposed" and ndim < 4:
        layout = "sliced"
    return shape, layout, draw(st.integers(0, 2**31))


# -- Log1p ------------------------------------------------------------------------------


@SETTINGS
@given(batch=batches(), cast=st.sampled_from(CASTS), scale=st.sampled_from([1.0, 0.25, 3.0]))
def test_log1p_matches_torch(batch, cast, scale):
    shape, layout, seed = batch
    dtype_in, dtype = cast
    x = make(shape, dtype_in, layout, seed, low=-0.3, high=50.0)
    y = T.Log1p(scale=scale, dtype=dtype)(x)
    want = T.log1p_reference(x, scale=scale, dtype=out_dtype(dtype_in, dtype))
    assert y.dtype == want.dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y, want, **TOL[y.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log1p_is_accurate_over_the_whole_range(dtype):
    """The kernel's own branch-free log1p: within 2 ulp of torch's over many magnitudes."""
    tiny, big = (1e-37, 3e38) if dtype == torch.float32 else (1e-300, 1e308)
    mags = np.geomspace(tiny, big, 20_000)
    x = torch.from_numpy(np.concatenate([mags, -mags[mags < 1.0], [0.0, -0.5, -0.999]]))
    x = x.to(dtype)
    y = T.Log1p(dtype=dtype)(x)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, torch.log1p(x), rtol=2 * eps, atol=0)


def test_log1p_follows_torch_at_the_domain_edge():
    x = torch.tensor([-1.0, -2.0, -np.inf, np.inf, np.nan, 0.0, -0.0, 1e-30, -0.5])
    y = T.Log1p(scale=2.0)(x)
    want = torch.log1p(2.0 * x)  # -inf at -1, nan below, +inf at +inf
    torch.testing.assert_close(y, want, equal_nan=True)
    assert torch.equal(torch.signbit(y[5:7]), torch.tensor([False, True]))


def test_log1p_of_integers_writes_the_default_float_dtype():
    x = torch.arange(12, dtype=torch.int32).reshape(1, 3, 2, 2)
    y = T.Log1p(scale=0.5)(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.log1p(x * 0.5))
    assert T.Log1p(dtype=torch.float16)(x).dtype == torch.float16


# -- Standardize ------------------------------------------------------------------------


@SETTINGS
@given(batch=batches(), cast=st.sampled_from(CASTS), data=st.data())
def test_standardize_matches_torch(batch, cast, data):
    shape, layout, seed = batch
    dtype_in, dtype = cast
    channels = shape[1]
    mean = data.draw(st.lists(st.floats(-5, 5), min_size=channels, max_size=channels))
    std = data.draw(st.lists(st.floats(0.1, 10), min_size=channels, max_size=channels))
    x = make(shape, dtype_in, layout, seed)
    y = T.Standardize(mean=mean, std=std, dtype=dtype)(x)
    want = T.standardize_reference(x, mean=mean, std=std, dtype=out_dtype(dtype_in, dtype))
    assert y.dtype == want.dtype and y.shape == x.shape
    torch.testing.assert_close(y, want, **TOL[y.dtype])


def test_standardize_fit_matches_the_statistics_of_the_samples_read():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 3, 4, 4)) * np.array([1.0, 5.0, 0.1])[:, None, None] + 7.0
    source = dfl.io.ArraySource(x.astype(np.float32))
    fitted = T.Standardize.fit(source, samples=1000, batch=7)  # all 50, uneven batches
    data = torch.from_numpy(x.astype(np.float32)).double()
    np.testing.assert_allclose(fitted.mean, data.mean(dim=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(fitted.std, data.std(dim=(0, 2, 3), correction=0), rtol=1e-10)
    y = fitted(torch.from_numpy(x.astype(np.float32)))
    torch.testing.assert_close(y.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.std(dim=(0, 2, 3), correction=0), torch.ones(3))


def test_standardize_fit_draws_a_reproducible_subset(tmp_path):
    x = np.random.default_rng(2).normal(size=(40, 2, 3, 3)).astype(np.float32)
    source = dfl.io.ZarrSource(dfl.io.to_zarr(tmp_path / "x.zarr", x), x="x", y=None)
    a = T.Standardize.fit(source, samples=10, seed=3)
    assert a == T.Standardize.fit(source, samples=10, seed=3)
    assert a != T.Standardize.fit(source, samples=10, seed=4)
    picked = np.sort(np.random.default_rng([3]).choice(40, size=10, replace=False))
    np.testing.assert_allclose(a.mean, x[picked].astype(np.float64).mean(axis=(0, 2, 3)))


def test_standardize_fit_refuses_a_constant_channel():
    x = np.ones((8, 2, 3, 3), dtype=np.float32)
    x[:, 1] = np.arange(8)[:, None, None]
    with pytest.raises(ConfigError, match=r"channel\(s\) \[0\].*constant"):
        T.Standardize.fit(dfl.io.ArraySource(x))


def test_standardize_refuses_bad_statistics_and_channel_counts():
    with pytest.raises(ConfigError, match=r"std must be > 0, channel\(s\) \[1\]"):
        T.Standardize(mean=(0.0, 0.0), std=(1.0, 0.0))
    with pytest.raises(ConfigError, match="mean has 2 values and std 1"):
        T.Standardize(mean=(0.0, 0.0), std=(1.0,))
    with pytest.raises(ConfigError, match=r"Standardize\(mean=.*finite"):
        T.Standardize(mean=(np.nan,), std=(1.0,))
    op = T.Standardize(mean=(0.0, 1.0), std=(1.0, 2.0))
    with pytest.raises(OpError, match=r"x has 3 channels .* mean/std have 2"):
        op(torch.zeros(4, 3, 2, 2))


# -- RandomFlip -------------------------------------------------------------------------


@st.composite
def flip_axes(draw, ndim):
    axes = draw(st.lists(st.integers(2, ndim - 1), min_size=1, max_size=ndim - 2, unique=True))
    return tuple(axes)


@SETTINGS
@given(batch=batches(ndims=(3, 4, 5)), cast=st.sampled_from(CASTS), data=st.data())
def test_random_flip_matches_per_sample_torch_flip(batch, cast, data):
    shape, layout, seed = batch
    dtype_in, dtype = cast
    axes = data.draw(flip_axes(len(shape)))
    p = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    x = make(shape, dtype_in, layout, seed)
    op = T.RandomFlip(axes=axes, p=p, dtype=dtype)
    step_seed = (seed, 7, 1)
    y = op(x, seed=step_seed)
    flags = T.draw_flips(len(x), len(axes), p, step_seed)
    want = T.flip_reference(x, flags=flags, axes=axes, dtype=out_dtype(dtype_in, dtype))
    assert torch.equal(y, want)


def test_random_flip_is_reproducible_per_seed_and_differs_across_seeds():
    x = torch.arange(16 * 2 * 5 * 5, dtype=torch.float32).reshape(16, 2, 5, 5)
    op = T.RandomFlip(axes=(2, 3))
    assert op.wants_seed
    a = op(x, seed=(0, 3, 1))
    assert torch.equal(a, op(x, seed=(0, 3, 1)))
    assert not torch.equal(a, op(x, seed=(0, 4, 1)))  # 2^-32 odds of equal choices
    assert not torch.equal(op(x), op(x))  # no seed: fresh entropy each call
    assert torch.equal(T.RandomFlip(p=0.0)(x, seed=1), x)
    assert torch.equal(T.RandomFlip(p=1.0)(x, seed=1), x.flip(2, 3))


# -- RandomRotate90 ---------------------------------------------------------------------


@st.composite
def rotation_cases(draw):
    ndim = draw(st.sampled_from([4, 5]))
    axes = tuple(draw(st.permutations(range(2, ndim)))[:2])
    shape = [draw(st.integers(1, 4)), draw(st.integers(1, 3))]
    shape += [draw(st.integers(1, 9)) for _ in range(ndim - 2)]
    shape[axes[1]] = shape[axes[0]]
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    return tuple(shape), axes, layout, draw(st.integers(0, 2**31))


@SETTINGS
@given(case=rotation_cases(), cast=st.sampled_from(CASTS))
def test_random_rotate90_matches_per_sample_torch_rot90(case, cast):
    shape, axes, layout, seed = case
    dtype_in, dtype = cast
    x = make(shape, dtype_in, layout, seed)
    y = T.RandomRotate90(axes=axes, dtype=dtype)(x, seed=seed)
    ks = T.draw_rotations(len(x), seed)
    want = T.rot90_reference(x, ks=ks, axes=axes, dtype=out_dtype(dtype_in, dtype))
    assert torch.equal(y, want)


@pytest.mark.parametrize("axes", [(2, 3), (3, 2), (2, 4), (3, 4)])
def test_random_rotate90_turns_every_sample_by_its_drawn_quarter(axes):
    """All four k on large planes (the tiled transpose runs over several tiles)."""
    seed = next(s for s in range(100) if set(T.draw_rotations(8, s)) == {0, 1, 2, 3})
    x = torch.randn(8, 2, 37, 37, 37)
    y = T.RandomRotate90(axes=axes)(x, seed=seed)
    drawn = T.draw_rotations(8, seed)
    for n in range(8):
        assert torch.equal(y[n], torch.rot90(x[n], int(drawn[n]), (axes[0] - 1, axes[1] - 1)))


def test_random_rotate90_draws_all_quarters_reproducibly():
    ks = T.draw_rotations(4000, (1, 2, 3))
    assert np.array_equal(ks, T.draw_rotations(4000, (1, 2, 3)))
    assert sorted(np.unique(ks)) == [0, 1, 2, 3]
    assert abs(np.mean(ks == 1) - 0.25) < 0.03


def test_random_rotate90_refuses_a_non_square_plane():
    op = T.RandomRotate90(axes=(2, 3))
    with pytest.raises(OpError, match=r"sizes 4 and 5; a quarter turn swaps them"):
        op(torch.zeros(2, 1, 4, 5), seed=0)


# -- bad input --------------------------------------------------------------------------

ALL = [
    T.Log1p(),
    T.Standardize(mean=(0.0,), std=(1.0,)),
    T.RandomFlip(),
    T.RandomRotate90(),
]


@pytest.mark.parametrize("op", ALL, ids=lambda op: type(op).__name__)
def test_bfloat16_is_refused_naming_op_dtype_and_what_is_supported(op):
    with pytest.raises(OpError, match=rf"{type(op).__name__}: dtype torch.bfloat16 .*supported"):
        op(torch.zeros(2, 1, 4, 4, dtype=torch.bfloat16))
    with pytest.raises(OpError, match=r"dtype=torch.bfloat16.*supported: float16, float32"):
        type(op)(**{**_fields(op), "dtype": torch.bfloat16})


@pytest.mark.parametrize("op", ALL, ids=lambda op: type(op).__name__)
def test_unsupported_device_is_refused_naming_it(op):
    with pytest.raises(OpError, match=rf"{type(op).__name__}: device meta .*supported: dtypes"):
        op(torch.zeros(2, 1, 4, 4, device="meta"))


@pytest.mark.parametrize("op", ALL, ids=lambda op: type(op).__name__)
def test_numpy_input_is_refused_with_the_fix(op):
    with pytest.raises(OpError, match=r"torch.from_numpy"):
        op(np.zeros((2, 1, 4, 4), dtype=np.float32))


def _fields(op):
    return {f.name: getattr(op, f.name) for f in dataclasses.fields(op)}


def test_float_ops_refuse_an_integer_output_dtype():
    with pytest.raises(OpError, match=r"Log1p\(dtype=torch.int32\).*supported: float16"):
        T.Log1p(dtype=torch.int32)
    with pytest.raises(ConfigError, match=r"expected a torch.dtype such as torch.float32"):
        T.Log1p(dtype="float32")


def test_configs_name_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"Log1p\(scale=inf\): expected a finite number"):
        T.Log1p(scale=float("inf"))
    with pytest.raises(ConfigError, match=r"RandomFlip\(p=1.5\): p is a probability"):
        T.RandomFlip(p=1.5)
    with pytest.raises(ConfigError, match=r"RandomFlip\(axes=\(1, 2\)\): expected distinct"):
        T.RandomFlip(axes=(1, 2))
    with pytest.raises(ConfigError, match=r"RandomRotate90\(axes=\(2, 3, 4\)\): expected exactly"):
        T.RandomRotate90(axes=(2, 3, 4))
    with pytest.raises(OpError, match=r"axes \(2, 4\) do not exist .* pick axes in 2..3"):
        T.RandomFlip(axes=(2, 4))(torch.zeros(1, 1, 3, 3), seed=0)
    with pytest.raises(ConfigError, match=r"seed must be None, a non-negative int"):
        T.RandomFlip()(torch.zeros(1, 1, 3, 3), seed=(-1, 0))


def test_outputs_are_new_tensors_and_inputs_are_untouched():
    x = torch.rand(3, 2, 4, 4)
    before = x.clone()
    for op in [*ALL[:1], T.Standardize(mean=(0.5, 0.5), std=(2.0, 2.0)), *ALL[2:]]:
        y = op(x) if not getattr(op, "wants_seed", False) else op(x, seed=0)
        assert y.data_ptr() != x.data_ptr()
    assert torch.equal(x, before)


def test_cpu_kernels_use_as_many_threads_as_torch():
    """A Dask replica sets torch's thread budget; the kernels must not oversubscribe it
    (and tiny inputs run on one thread: registry.match_torch_threads)."""
    import numba

    before = torch.get_num_threads()
    big = torch.rand(4, 1, 128, 128)  # above registry.PARALLEL_MIN elements
    try:
        torch.set_num_threads(1)
        T.Log1p()(big)
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    T.Log1p()(big)
    assert numba.get_num_threads() == min(before, numba.config.NUMBA_NUM_THREADS)


def test_float16_conversions_match_torch_for_every_bit_pattern():
    """The CPU kernels convert float16 through LLVM: all 65536 halves widen exactly, and
    float32 values (ties, subnormals, overflow, nan) round to float16 as torch does."""
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = halves.reshape(16, 1, 64, 64)
    widened = T.RandomFlip(p=0.0, dtype=torch.float32)(x, seed=0)
    torch.testing.assert_close(widened, x.float(), rtol=0, atol=0, equal_nan=True)
    rng = np.random.default_rng(0)
    mags = 2.0 ** rng.uniform(-30, 18, size=65536 - 8)
    edge = [65504.0, 65520.0, 70000.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-24, np.inf, np.nan]
    values = torch.from_numpy(np.concatenate([mags * rng.choice([-1, 1], mags.size), edge]))
    x32 = values.float().reshape(16, 1, 64, 64)
    narrowed = T.RandomFlip(p=0.0, dtype=torch.float16)(x32, seed=0)
    assert torch.equal(
        narrowed.view(torch.int16)[~narrowed.isnan()],
        x32.half().view(torch.int16)[~narrowed.isnan()],
    )
    assert torch.equal(narrowed.isnan(), x32.half().isnan())
