"""The torch code that runs on CUDA in place of a Numba kernel (an op's ``torch_cuda``),
run here on CPU tensors: RandomFlip and RandomRotate90 equal their CPU kernels bit for
bit; FusedSGD's torch path is torch's fused SGD and keeps the optimizer's state.

``torch_launch`` replaces ``registry.launch`` with what it does for CUDA tensors when an
op has no Numba CUDA kernel, so everything else (choices, reshapes, casts) is the real
call path.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conftest import TinyCNN

from dataflow.ops import optim, registry
from dataflow.ops import transforms as T
from dataflow.ops.optim import FusedSGD
from dataflow.ops.optim_kernels import SGD_STEP


def torch_launch(op, *tensors, inplace=(), **params):
    """``registry.launch``'s CUDA branch for an op without a Numba CUDA kernel."""
    registry.check(op, tensors, inplace)
    assert op.cuda is None
    return op.torch_cuda(*tensors, **params)


# -- RandomFlip, RandomRotate90 ---------------------------------------------------------

INTS = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
# (input dtype, dtype=): every supported input as it is, and casts either way
CASTS = [(d, None) for d in T.SUPPORTED] + [
    (torch.float16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float64, torch.float16),
    (torch.float64, torch.float32),
    (torch.int32, torch.float32),
    (torch.uint8, torch.float16),
    (torch.int64, torch.float64),
    (torch.float32, torch.int16),
]


def batch(shape, dtype_in, dtype, seed, view=False):
    """Random values the cast keeps in range; same-dtype floats carry nan, ±inf, -0."""
    rng = np.random.default_rng(seed)
    if view:  # a transposed view of the last two axes
        shape = (*shape[:-2], shape[-1], shape[-2])
    ints = dtype_in in INTS or dtype in INTS
    low = 0 if torch.uint8 in (dtype_in, dtype) else -100
    x = rng.uniform(low, 100, size=shape)
    if not ints and dtype in (None, dtype_in) and x.size >= 4:
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size, size=4)] = [np.nan, np.inf, -np.inf, -0.0]
    x = torch.from_numpy(x).to(dtype_in)
    return x.transpose(-1, -2) if view else x


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
    if a.dtype.is_floating_point:
        raw = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(raw), b.view(raw)
    assert torch.equal(a, b)


# The casts compared with the CPU kernel itself; the others with the op's plain reference
# (which the kernels equal: tests/test_ops_transforms.py). Each (input, output) dtype
# pair compiles the kernel anew, about 2 s in a fresh clone: all 16 cost half a minute.
KERNEL_CASTS = {
    (torch.float32, None),
    (torch.uint8, torch.float16),
    (torch.float64, torch.float32),
    (torch.float32, torch.int16),
}


def both(op, x, seed, monkeypatch):
    """``op(x, seed)`` by the CPU kernel (or, for a cast outside ``KERNEL_CASTS``, by the
    op's reference on the same choices), and by the torch code CUDA runs."""
    if (x.dtype, op.dtype) in KERNEL_CASTS:
        expected = op(x, seed=seed)
    else:
        dtype = op.dtype or x.dtype
        choices = op.choices(len(x), seed)
        if isinstance(op, T.RandomFlip):
            expected = T.flip_reference(x, flags=choices, axes=op.axes, dtype=dtype)
        else:
            expected = T.rot90_reference(x, ks=choices, axes=op.axes, dtype=dtype)
        expected = expected.contiguous()
    with monkeypatch.context() as patch:
        patch.setattr(T, "launch", torch_launch)
        torch_path = op(x, seed=seed)
    return expected, torch_path


FLIP_SHAPES = [((3, 2, 5), (2,)), ((4, 1, 6, 7), (2, 3)), ((5, 2, 3, 4, 6), (2, 3, 4))]
FLIP_SHAPES += [((6, 1, 4, 5, 3), (4, 2)), ((2, 3, 4, 5), (3,)), ((0, 1, 4, 4), (2, 3))]


@pytest.mark.parametrize(("shape", "axes"), FLIP_SHAPES, ids=str)
@pytest.mark.parametrize(("dtype_in", "dtype"), CASTS, ids=str)
def test_random_flip_torch_path_equals_the_cpu_kernel_bit_for_bit(
    shape, axes, dtype_in, dtype, monkeypatch
):
    for i, (seed, p) in enumerate([((0, 1, 0), 0.5), ((7, 3, 1), 0.5), (12345, 1.0)]):
        op = T.RandomFlip(axes=axes, p=p, dtype=dtype)
        x = batch(shape, dtype_in, dtype, i, view=i == 1 and len(shape) > 3)
        assert_bits_equal(*both(op, x, seed, monkeypatch))


ROT_SHAPES = [
    ((8, 2, 5, 5), (2, 3)),
    ((8, 1, 4, 4), (3, 2)),
    ((8, 2, 3, 4, 3), (2, 4)),
    ((8, 1, 2, 6, 6), (3, 4)),
    ((8, 1, 5, 5, 2), (3, 2)),
    ((1, 2, 4, 4), (2, 3)),  # one sample: one group
    ((0, 1, 3, 3), (2, 3)),
]
ALL_QUARTERS = next(s for s in range(100) if set(T.draw_rotations(8, s)) == {0, 1, 2, 3})
THREE_QUARTERS = next(s for s in range(100) if len(set(T.draw_rotations(8, s))) == 3)


@pytest.mark.parametrize(("shape", "axes"), ROT_SHAPES, ids=str)
@pytest.mark.parametrize(("dtype_in", "dtype"), CASTS, ids=str)
def test_random_rotate90_torch_path_equals_the_cpu_kernel_bit_for_bit(
    shape, axes, dtype_in, dtype, monkeypatch
):
    for seed in [ALL_QUARTERS, THREE_QUARTERS, (5, 2, 1)]:
        op = T.RandomRotate90(axes=axes, dtype=dtype)
        x = batch(shape, dtype_in, dtype, seed if isinstance(seed, int) else 3)
        assert_bits_equal(*both(op, x, seed, monkeypatch))
        if shape[-1] == shape[-2]:
            y = batch(shape, dtype_in, dtype, 4, view=True)
            assert_bits_equal(*both(op, y, seed, monkeypatch))


def test_flip_and_rotate_run_torch_code_on_cuda_and_keep_no_numba_kernel():
    for op in (T.FLIP, T.ROT90):
        assert op.cuda is None and op.torch_cuda is not None
        assert "on cpu, cuda" in registry._supported(op)
    for op in (T.LOG1P, T.STANDARDIZE):  # these keep their Numba CUDA kernels
        assert op.cuda is not None and op.torch_cuda is None


def test_the_torch_paths_turn_and_flip_as_torch_does(monkeypatch):
    """Not only equal to the kernel: each sample is torch.flip / torch.rot90 of its input."""
    monkeypatch.setattr(T, "launch", torch_launch)
    x = torch.arange(8 * 2 * 3 * 4 * 4, dtype=torch.float32).reshape(8, 2, 3, 4, 4)
    ks = T.draw_rotations(8, ALL_QUARTERS)
    y = T.RandomRotate90(axes=(4, 3))(x, seed=ALL_QUARTERS)
    for n in range(8):
        assert torch.equal(y[n], torch.rot90(x[n], int(ks[n]), (3, 2)))
    flags = T.draw_flips(8, 2, 0.5, 9)
    y = T.RandomFlip(axes=(2, 4))(x, seed=9)
    for n in range(8):
        dims = [a - 1 for a, f in zip((2, 4), flags[n], strict=True) if f]
        assert torch.equal(y[n], x[n].flip(dims) if dims else x[n])


# -- FusedSGD ----------------------------------------------------------------------------

SGD_CONFIGS = {
    "plain": dict(lr=0.05),
    "momentum+decay": dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
    "nesterov+decay": dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "dampening+maximize": dict(lr=0.05, momentum=0.8, dampening=0.2, maximize=True),
}


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(16, 1, 8, 8, generator=g), torch.randint(3, (16,), generator=g)


def train(model, opt, data, maximize=False):
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (-loss if maximize else loss).backward()
        opt.step()
    return model


def new_model():
    torch.manual_seed(0)
    return TinyCNN()


def assert_close_params(a, b):
    # torch's CPU fused SGD rounds its vectorised body and its scalar tail differently,
    # and a flat buffer puts the tails elsewhere than a list of tensors: equal to an ulp
    # here; on CUDA the fused kernel is one formula per element, bit for bit
    # (tests/test_ops_flat_cudasim.py's gpu test).
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", sorted(SGD_CONFIGS))
def test_fused_sgd_torch_path_is_torchs_fused_sgd(config, monkeypatch):
    monkeypatch.setattr(optim, "launch", torch_launch)
    kw = SGD_CONFIGS[config]
    maximize = kw.get("maximize", False)
    ours = new_model()
    opt = FusedSGD(ours.parameters(), **kw)
    train(ours, opt, batches(20), maximize)
    theirs = new_model()
    train(theirs, torch.optim.SGD(theirs.parameters(), **kw, fused=True), batches(20), maximize)
    assert_close_params(ours, theirs)
    if kw.get("momentum"):  # the state torch keeps: views of the flat momentum buffer
        flat = opt._flats[0][0]
        views = flat.views(flat.buffers["momentum_buffer"])
        for p, view in zip(flat.params, views, strict=True):
            assert opt.state[p]["momentum_buffer"].data_ptr() == view.data_ptr()


def roundtrip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_fused_sgd_torch_path_state_dict_round_trips_through_torch(monkeypatch):
    monkeypatch.setattr(optim, "launch", torch_launch)
    kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    data = list(batches(15))
    reference = new_model()
    train(reference, torch.optim.SGD(reference.parameters(), **kw, fused=True), data)

    model = new_model()
    first = FusedSGD(model.parameters(), **kw)
    train(model, first, data[:5])
    middle = torch.optim.SGD(model.parameters(), **kw, fused=True)
    middle.load_state_dict(roundtrip(first.state_dict()))
    train(model, middle, data[5:10])
    last = FusedSGD(model.parameters(), **kw)
    last.load_state_dict(roundtrip(middle.state_dict()))
    train(model, last, data[10:])
    assert_close_params(model, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sgd_torch_step_matches_the_reference_and_the_cpu_kernel(dtype):
    rng = np.random.default_rng(0)
    cases = [
        dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
        dict(momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=True, maximize=False),
        dict(momentum=0.8, dampening=0.3, weight_decay=1e-3, nesterov=False, maximize=True),
    ]
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-13, atol=0)
    for case in cases:
        p, g, m = (torch.from_numpy(rng.normal(size=1000)).to(dtype) for _ in range(3))
        for first in (True, False):
            expected = SGD_STEP.reference(p, g, m, lr=0.1, first=first, **case)
            kernel = [t.clone() for t in (p, g, m)]
            registry.launch(SGD_STEP, *kernel, inplace=(0, 2), lr=0.1, first=first, **case)
            got = [t.clone() for t in (p, g, m)]
            torch_launch(SGD_STEP, *got, inplace=(0, 2), lr=0.1, first=first, **case)
            torch.testing.assert_close(got[0], expected[0], **tol)
            torch.testing.assert_close(got[0], kernel[0], **tol)
            if case["momentum"]:
                torch.testing.assert_close(got[2], expected[1], **tol)
                torch.testing.assert_close(got[2], kernel[2], **tol)
