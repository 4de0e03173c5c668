"""The data-path ops on CUDA: the Numba CUDA kernels under Numba's CUDA simulator, and
every op on a real GPU.

``NUMBA_ENABLE_CUDASIM=1`` must be set before numba is imported, so the simulator runs
in a subprocess: this file run as a script. There, ``launch`` is replaced by one that
copies the tensors to simulated device arrays and calls each op's ``Op.cuda`` with
``stream=0``; everything else (choices, reshapes, dtypes) is the real call path.
RandomFlip and RandomRotate90 have no Numba CUDA kernel (torch code runs on CUDA, tested
bit for bit against the CPU kernels in test_ops_torch_paths.py): only the GPU tests run
them here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dataflow.ops import transforms as T

# The simulator runs one Python thread per CUDA thread: tiny shapes only.
SHAPES = [(2, 2, 4, 4), (2, 1, 3, 3, 3)]
CASTS = [
    (torch.float32, None),
    (torch.float64, None),
    (torch.float16, torch.float32),
    (torch.float32, torch.float16),
    (torch.int32, torch.float32),
]
TOL = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-7},
    torch.float64: {"rtol": 1e-14, "atol": 1e-15},
    torch.float16: {"rtol": 1e-3, "atol": 1e-4},
}


ALL_QUARTERS = next(s for s in range(100) if sorted(T.draw_rotations(4, s)) == [0, 1, 2, 3])


def cases() -> Iterator[tuple[str, Callable[..., torch.Tensor], torch.Tensor, Any]]:
    """(label, op, input, seed) over every op, shape and dtype pair; one input is a view."""
    for shape in SHAPES:
        for dtype_in, dtype in CASTS:
            base = torch.from_numpy(np.random.default_rng(len(shape)).uniform(-0.5, 9, shape))
            x = base.to(dtype_in)
            label = f"{shape} {dtype_in}->{dtype}"
            spatial = tuple(range(2, len(shape)))
            yield f"Log1p {label}", T.Log1p(scale=0.5, dtype=dtype), x, None
            stats = {"mean": tuple(range(shape[1])), "std": tuple(0.5 + c for c in range(shape[1]))}
            yield f"Standardize {label}", T.Standardize(**stats, dtype=dtype), x, None
            flip = T.RandomFlip(axes=spatial, dtype=dtype)
            yield f"RandomFlip {label}", flip, x, (1, 2, 3)
            yield f"RandomFlip view {label}", flip, x.transpose(-1, -2), (4, 5, 6)
            x4 = torch.cat([x, x.flip(0)])  # 4 samples, a seed that turns them by 0, 1, 2, 3
            for axes in [spatial[:2], spatial[-2:][::-1]]:
                rot = T.RandomRotate90(axes=axes, dtype=dtype)
                yield f"RandomRotate90 {axes} {label}", rot, x4, ALL_QUARTERS


def expected(op: Any, x: torch.Tensor, seed: Any) -> torch.Tensor:
    """The op's torch reference on the CPU, with the choices the op draws for ``seed``."""
    x = x.cpu()
    dtype = op.dtype or (x.dtype if x.dtype.is_floating_point else torch.get_default_dtype())
    if isinstance(op, T.Log1p):
        return T.log1p_reference(x, scale=op.scale, dtype=dtype)
    if isinstance(op, T.Standardize):
        return T.standardize_reference(x, mean=op.mean, std=op.std, dtype=dtype)
    if isinstance(op, T.RandomFlip):
        flags = op.choices(len(x), seed)
        return T.flip_reference(x, flags=flags, axes=op.axes, dtype=dtype)
    return T.rot90_reference(x, ks=op.choices(len(x), seed), axes=op.axes, dtype=dtype)


def run(op: Any, x: torch.Tensor, seed: Any) -> torch.Tensor:
    return op(x, seed=seed) if getattr(op, "wants_seed", False) else op(x)


def simulated_launch(op: Any, *tensors: torch.Tensor, inplace: Any = (), **params: Any) -> None:
    """``registry.launch`` for CPU tensors through the simulated device (last arg: output)."""
    from numba import cuda

    arrays = [cuda.to_device(t.contiguous().numpy()) for t in tensors]
    op.cuda(*arrays, stream=0, **params)
    tensors[-1].copy_(torch.from_numpy(arrays[-1].copy_to_host()))


def simulated_cases() -> list[tuple[str, Callable[..., torch.Tensor], torch.Tensor, Any]]:
    """The cases of the ops with a Numba CUDA kernel: Log1p, Standardize."""
    return [c for c in cases() if isinstance(c[1], T.Log1p | T.Standardize)]


def simulate() -> None:
    from numba import config

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    T.launch = simulated_launch
    failed = 0
    for label, op, x, seed in simulated_cases():
        y, want = run(op, x, seed), expected(op, x, seed)
        try:
            assert y.dtype == want.dtype, f"dtype {y.dtype} != {want.dtype}"
            torch.testing.assert_close(y, want, **TOL[y.dtype])
            print(f"ok {label}")
        except AssertionError as e:
            failed += 1
            print(f"FAILED {label}: {e}")
    sys.exit(1 if failed else 0)


@pytest.mark.slow  # a child interpreter with the simulator on
def test_cuda_kernels_match_the_references_under_the_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(simulated_cases()) and all(line.startswith("ok ") for line in lines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(cases()), ids=lambda case: case[0])
def test_ops_on_a_cuda_tensor_match_the_cpu_reference(case):
    _, op, x, seed = case
    y = run(op, x.cuda(), seed)
    assert y.device.type == "cuda"
    want = expected(op, x, seed)
    assert y.dtype == want.dtype
    torch.testing.assert_close(y.cpu(), want, **TOL[y.dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ops_on_a_large_cuda_batch_match_the_cpu_kernels():
    """More elements than one capped grid has threads: the grid-stride loops, and torch's
    stream ordering (the input is written by torch just before the kernel reads it)."""
    x = torch.rand(8, 1, 130, 130, 130)  # 17.6 M elements > 65536 blocks * 256 threads
    standardize = T.Standardize(mean=(0.5,), std=(0.25,), dtype=torch.float16)
    for op in [T.Log1p(), standardize, T.RandomFlip(axes=(2, 3, 4)), T.RandomRotate90()]:
        y = run(op, x.cuda(), 5)
        torch.cuda.synchronize()
        torch.testing.assert_close(y.cpu(), run(op, x, 5), **TOL[y.dtype])


if __name__ == "__main__":
    simulate()
