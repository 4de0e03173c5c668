"""The CUDA kernels of the flat-buffer ops and of the fused optimizers.

Under ``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported, so in a subprocess) each
op's ``Op.cuda`` entry runs on numba's CPU simulator with simulated device arrays and
``stream=0``, against the op's reference; tiny sizes, the simulator is slow. The ``gpu``
tests run the same ops and both optimizers on real CUDA tensors against torch. FusedSGD
has no Numba CUDA kernel (torch's fused SGD runs on CUDA: test_ops_torch_paths.py tests
that path on the CPU; the ``gpu`` test here, bit for bit against ``SGD(fused=True)``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dataflow.ops import flat, halo
from dataflow.ops.layerwise import FusedLAMB, FusedLARS
from dataflow.ops.optim import FusedAdam, FusedSGD
from dataflow.ops.optim_kernels import ADAMW_STEP

F32_RTOL = 1e-5  # the simulator rounds a * b + c twice where the device fuses it
F64_RTOL = 1e-12


def _close(got, expected, dtype) -> None:
    rtol = F32_RTOL if dtype == np.float32 else F64_RTOL
    np.testing.assert_allclose(got, np.asarray(expected), rtol=rtol, atol=rtol)


def _arena(parts, rng, dtype):
    """Concatenate ``parts`` with random gaps: an arena and each part's start in it."""
    pieces, starts, at = [], [], 0
    for p in parts:
        gap = rng.normal(size=int(rng.integers(0, 4))).astype(dtype)
        pieces += [gap, p]
        starts.append(at + gap.size)
        at += gap.size + p.size
    return np.concatenate(pieces), np.array(starts, dtype=np.int64)


def simulated_flat_ops() -> None:
    """Every flat op's CUDA entry vs its reference (run under the simulator)."""
    from numba import config, cuda

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        sizes = [7, 0, 12, 5]
        parts = [rng.normal(size=n).astype(dtype) for n in sizes]
        arena, starts = _arena(parts, rng, dtype)
        src = starts.copy()
        src[2] = -1  # no gradient: zero-filled
        dst = np.concatenate([[0], np.cumsum(sizes[:-1])])
        table, bounds = flat.chunk_table(sizes, src, dst, 4)
        out = cuda.to_device(np.full(sum(sizes), np.nan, dtype))
        flat.PACK_SCALED.cuda(out, cuda.to_device(arena), table, stream=0, factor=0.25)
        tensors = [torch.from_numpy(p) for p in parts]
        tensors[2] = None
        expected = flat.PACK_SCALED.reference(tensors, factor=0.25, sizes=sizes)
        _close(out.copy_to_host(), expected, dtype)

        table, bounds = flat.chunk_table(sizes, starts, np.zeros(4, np.int64), 4)
        out = cuda.to_device(np.full(4, np.nan))
        flat.SUM_OF_SQUARES.cuda(cuda.to_device(arena), table, bounds, out, stream=0)
        expected = flat.SUM_OF_SQUARES.reference([torch.from_numpy(p) for p in parts])
        np.testing.assert_allclose(out.copy_to_host(), expected.numpy(), rtol=1e-12)

        x = rng.normal(size=(2, 3, 4, 2, 3)).astype(dtype)
        for axis, start, width in ((0, 1, 1), (2, 1, 2), (4, 0, 3)):
            shape = list(x.shape)
            shape[axis] = width
            slab = cuda.to_device(np.full(shape, np.nan, dtype))
            halo.PACK_HALO.cuda(cuda.to_device(x), slab, stream=0, axis=axis, start=start)
            xt = torch.from_numpy(x)
            expected = halo.PACK_HALO.reference(xt, axis=axis, start=start, width=width)
            _close(slab.copy_to_host(), expected, dtype)
            target = cuda.to_device(np.zeros_like(x))
            halo.UNPACK_HALO.cuda(target, slab, stream=0, axis=axis, start=start)
            expected = halo.UNPACK_HALO.reference(
                torch.zeros_like(xt), expected, axis=axis, start=start
            )
            _close(target.copy_to_host(), expected, dtype)
        print(f"flat ops ok: {np.dtype(dtype).name}")


ADAM_CASES = [
    dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=False),
    dict(beta1=0.3, beta2=0.9, eps=1e-6, weight_decay=0.0, maximize=True),  # lerp from end
]


def simulated_optimizer_kernels() -> None:
    """The AdamW CUDA kernel vs torch's update (run under the simulator)."""
    from numba import config, cuda

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float64):
        for case in ADAM_CASES:
            p, g, m = (rng.normal(size=37).astype(dtype) for _ in range(3))
            v = rng.uniform(0, 1, size=37).astype(dtype)
            for step in (1, 7):
                arrays = [cuda.to_device(a) for a in (p, g, m, v)]
                ADAMW_STEP.cuda(*arrays, stream=0, lr=1e-2, step=step, **case)
                tensors = (torch.from_numpy(a) for a in (p, g, m, v))
                expected = ADAMW_STEP.reference(*tensors, lr=1e-2, step=step, **case)
                for got, want in zip((arrays[0], arrays[2], arrays[3]), expected, strict=True):
                    _close(got.copy_to_host(), want, dtype)
        print(f"optimizer kernels ok: {np.dtype(dtype).name}")


def simulated_layerwise_kernels() -> None:
    """The LARS and LAMB CUDA kernels vs their per-tensor references (simulator): tensors
    of several chunks, an empty one, one of zeros (ratio 1), one that does not adapt."""
    from numba import config, cuda

    from dataflow.ops.layerwise import LAMB_STEP, LARS_STEP

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    rng = np.random.default_rng(2)
    sizes, adapt = [9, 0, 5, 6, 3], np.array([1, 1, 1, 0, 1], dtype=np.int8)
    starts = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64)
    table, bounds = flat.chunk_table(sizes, starts, starts, 4)
    table = np.ascontiguousarray(table[:, [0, 1, 3]])

    def split(a):
        return [torch.from_numpy(a[s : s + n].copy()) for s, n in zip(starts, sizes, strict=True)]

    for dtype in (np.float32, np.float64):
        p, g, m = (rng.normal(size=sum(sizes)).astype(dtype) for _ in range(3))
        v = rng.uniform(0, 1, size=sum(sizes)).astype(dtype)
        p[9:14] = 0  # the third tensor's weights are zero
        for first in (True, False):
            kw = dict(lr=0.5, momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=False,
                      trust_coefficient=0.02, eps=1e-8, first=first)  # fmt: skip
            arrays = [cuda.to_device(a) for a in (p, g, m)]
            LARS_STEP.cuda(*arrays, table, bounds, adapt, stream=0, **kw)
            want = LARS_STEP.reference(split(p), split(g), split(m), adapt.astype(bool), **kw)
            for got, expected in zip((arrays[0], arrays[2]), want, strict=True):
                _close(got.copy_to_host(), torch.cat(expected), dtype)
        for step in (1, 5):
            kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=step)
            arrays = [cuda.to_device(a) for a in (p, g, m, v)]
            LAMB_STEP.cuda(*arrays, table, bounds, adapt, stream=0, **kw)
            tensors = (split(a) for a in (p, g, m, v))
            want = LAMB_STEP.reference(*tensors, adapt.astype(bool), **kw)
            for got, expected in zip((arrays[0], arrays[2], arrays[3]), want, strict=True):
                _close(got.copy_to_host(), torch.cat(expected), dtype)
        print(f"layerwise kernels ok: {np.dtype(dtype).name}")


def _run_simulated(function: str) -> subprocess.CompletedProcess:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import test_ops_flat_cudasim as t; t.{function}()"
    )
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow  # a child interpreter with the simulator on
@pytest.mark.parametrize(
    ("function", "expected"),
    [
        ("simulated_flat_ops", ["flat ops ok: float32", "flat ops ok: float64"]),
        (
            "simulated_optimizer_kernels",
            ["optimizer kernels ok: float32", "optimizer kernels ok: float64"],
        ),
        (
            "simulated_layerwise_kernels",
            ["layerwise kernels ok: float32", "layerwise kernels ok: float64"],
        ),
    ],
)
def test_cuda_kernels_on_the_simulator(function, expected):
    result = _run_simulated(function)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line for line in result.stdout.splitlines() if " ok: " in line] == expected


# -- real CUDA -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flat_ops_on_cuda_match_torch(dtype):
    torch.manual_seed(0)
    cuda = dict(dtype=dtype, device="cuda")
    grads = [torch.randn(s, **cuda) for s in [(64, 3, 3, 3), (64,), (1000, 2048), (5,)]]
    grads[2] = grads[2].t()  # non-contiguous input
    sizes = [g.numel() for g in grads]
    out = torch.empty(sum(sizes), **cuda)
    flat.pack_scaled_(out, grads, 0.25)
    torch.testing.assert_close(out, torch.cat([g.reshape(-1) * 0.25 for g in grads]))
    flat.pack_scaled_(out, [grads[0], None, grads[2], grads[3]], 0.5, sizes=sizes)
    assert out[sizes[0] : sizes[0] + sizes[1]].eq(0).all()

    expected = torch.stack([g.double().pow(2).sum() for g in grads])
    torch.testing.assert_close(flat.sum_of_squares(grads), expected, rtol=1e-10, atol=0)

    torch.testing.assert_close(flat.sum_of_squares(grads), expected, rtol=1e-10, atol=0)  # cached
    torch.testing.assert_close(flat.grad_squared_norm(grads), expected.sum(), rtol=1e-10, atol=0)

    x = torch.randn(2, 3, 8, 9, 10, **cuda)
    for axis in range(5):
        for side in halo.SIDES:
            slab = halo.pack_halo(x, axis, 1, side)
            start = 0 if side == "low" else x.shape[axis] - 1
            torch.testing.assert_close(slab, x.narrow(axis, start, 1), rtol=0, atol=0)
            target = torch.zeros_like(x)
            halo.unpack_halo_(target, slab, axis, 1, side)
            torch.testing.assert_close(target.narrow(axis, start, 1), slab, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            lambda p: FusedSGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
        ),
        (lambda p: FusedAdam(p, lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False)),
    ],
)
def test_fused_optimizers_on_cuda_match_torch(ours, theirs):
    torch.backends.cudnn.deterministic = True

    def train(make):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 3)
        ).to(device="cuda", dtype=torch.float64)
        opt = make(model.parameters())
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(20):
            x = torch.randn(8, 1, 8, 8, device="cuda", dtype=torch.float64, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return model

    for a, b in zip(train(ours).parameters(), train(theirs).parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_sgd_on_cuda_is_torchs_fused_sgd_bit_for_bit(dtype):
    """On CUDA FusedSGD runs torch's fused kernel over its flat buffer: one formula per
    element, so the same weights as ``torch.optim.SGD(fused=True)`` to the bit."""
    torch.backends.cudnn.deterministic = True
    kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)

    def train(make):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 3)
        ).to(device="cuda", dtype=dtype)
        opt = make(model.parameters())
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(20):
            x = torch.randn(8, 1, 8, 8, device="cuda", dtype=dtype, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return model, opt

    (ours, opt), (theirs, _) = (
        train(lambda p: FusedSGD(p, **kw)),
        train(lambda p: torch.optim.SGD(p, **kw, fused=True)),
    )
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(s["momentum_buffer"].is_cuda for s in opt.state.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedLARS(p, lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02),
        lambda p: FusedLAMB(p, lr=1e-2, weight_decay=1e-2),
    ],
    ids=["lars", "lamb"],
)
def test_layerwise_optimizers_on_cuda_match_the_cpu(make):
    """The Numba CUDA kernels (three launches a step) train as the CPU ones do."""
    torch.backends.cudnn.deterministic = True

    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 3)
        ).to(device=device, dtype=torch.float64)
        opt = make(model.parameters())
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            x = torch.randn(8, 1, 8, 8, dtype=torch.float64, generator=g).to(device)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return model

    for a, b in zip(train("cuda").parameters(), train("cpu").parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-7, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "make",
    [lambda p: FusedLARS(p, lr=0.5, momentum=0.9), lambda p: FusedLAMB(p, lr=1e-2)],
    ids=["lars", "lamb"],
)
def test_layerwise_steps_on_cuda_make_no_host_sync(make):
    """Issue 37 item 1 for the layer-wise optimizers: the norms, ratios and update stay
    on the device (three launches on torch's stream), so a step never waits for it."""
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten()).cuda()
    opt = make(model.parameters())
    x = torch.randn(8, 1, 8, 8, device="cuda")
    for step in range(3):  # the first compiles the kernels and builds the tables
        opt.zero_grad()
        model(x).square().mean().backward()
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in model.parameters())
