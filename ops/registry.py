"""One op = a CPU kernel, a CUDA kernel and a reference, behind one dispatching call.

Adding an op means writing its two kernels and its reference and registering
them; :func:`launch` does the rest: it checks device, dtype and layout, passes
tensors zero-copy (``tensor.numpy()`` on CPU, ``numba.cuda.as_cuda_array`` on
CUDA) and launches CUDA kernels on torch's current stream, so they are ordered
with torch's own kernels.

Layout: kernels index flat or C-contiguous memory. A non-contiguous input is
copied to a contiguous one (correct, not free); an argument the kernel writes in
place (``inplace=``) must already be contiguous, else the op raises, because
writing into a copy would silently lose the result.

CUDA kernels are compiled lazily (numba-cuda imported on first CUDA use), so CPU
users never pay for it, and under ``NUMBA_ENABLE_CUDASIM=1`` they run on the CPU
simulator, which is how CI tests them against the same references.

Where an op's Numba CUDA kernel lost to torch on the device (``benchmarks/bench_gpu.py``)
it was removed, and the op's ``torch_cuda`` (torch code, tested on CPU tensors against
the CPU kernel) runs on CUDA tensors instead.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numba import njit, prange

from dataflow.core.errors import ConfigError
from dataflow.core.protocols import Kernel, missing_members


class OpError(ConfigError):
    """An op was given a dtype, device or layout it does not support."""


@dataclass(frozen=True)
class Op:
    """The :class:`dataflow.core.protocols.Kernel` of this package. ``cpu(*arrays,
    **params)`` takes numpy arrays; ``cuda(*device_arrays, stream=, **params)`` takes numba
    device arrays; ``reference`` is the plain torch/numpy definition both are tested
    against. ``torch_cuda(*tensors, **params)``, for an op without a ``cuda`` kernel, is
    torch code that runs on CUDA tensors instead (the arguments of ``cpu``, as tensors),
    queued on torch's current stream like any torch op."""

    name: str
    cpu: Callable[..., Any]
    cuda: Callable[..., Any] | None
    reference: Callable[..., Any]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    extra: dict[str, Any] = field(default_factory=dict)
    torch_cuda: Callable[..., Any] | None = None

    @property
    def on_cuda(self) -> bool:
        """Whether CUDA tensors are supported (a Numba kernel or torch code)."""
        return self.cuda is not None or self.torch_cuda is not None


REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Add ``op`` to :data:`REGISTRY`; it must fit :class:`dataflow.core.protocols.Kernel`."""
    if not isinstance(op, Kernel):
        raise ConfigError(
            f"ops: cannot register {type(op).__name__}: it has no "
            f"{', '.join(map(repr, missing_members(op, Kernel)))}; build an ops.Op(name=, "
            "cpu=, cuda=, reference=)"
        )
    if op.name in REGISTRY:
        raise ConfigError(f"ops: an op named {op.name!r} is already registered")
    REGISTRY[op.name] = op
    return op


def _supported(op: Op) -> str:
    names = ", ".join(str(d).removeprefix("torch.") for d in op.dtypes)
    devices = "cpu, cuda" if op.on_cuda else "cpu"
    return f"dtypes {names} on {devices}"


def check(op: Op, tensors: Sequence[torch.Tensor], inplace: Sequence[int] = ()) -> torch.device:
    """The common device of ``tensors``; raise OpError naming what is unsupported."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise OpError(
            f"{op.name}: all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    device = devices.pop()
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not op.on_cuda):
        raise OpError(f"{op.name}: device {device} is not supported; supported: {_supported(op)}")
    for t in tensors:
        if t.dtype not in op.dtypes:
            raise OpError(
                f"{op.name}: dtype {t.dtype} is not supported; supported: {_supported(op)}"
            )
    for i in inplace:
        if not tensors[i].is_contiguous():
            raise OpError(
                f"{op.name}: argument {i} is written in place and must be contiguous "
                f"(shape {tuple(tensors[i].shape)}, stride {tensors[i].stride()}); pass "
                "tensor.contiguous() and use the result"
            )
    return device


def as_arrays(tensors: Sequence[torch.Tensor], device: torch.device) -> list[Any]:
    """Zero-copy views for the kernels (contiguous copies of non-contiguous inputs)."""
    tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    if device.type == "cpu":
        return [t.detach().numpy() for t in tensors]
    from numba import cuda

    return [cuda.as_cuda_array(t.detach()) for t in tensors]


def torch_stream() -> Any:
    """Torch's current CUDA stream as a numba stream (kernels queue behind torch's)."""
    from numba import cuda

    _quiet_low_occupancy()
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


@functools.cache
def _quiet_low_occupancy() -> None:
    """Our grids are sized to the work: a small bucket gets a small grid on purpose.
    numba-cuda warns about every such launch (NumbaPerformanceWarning, "Grid size 1 will
    likely result in GPU under-utilization"), which floods a fit's log; turn it off.
    numba-cuda >= 0.20 keeps the switch in its own config module, older in numba's."""
    for name in ("numba.cuda.core.config", "numba.core.config"):
        try:
            config = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(config, "CUDA_LOW_OCCUPANCY_WARNINGS"):
            config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


def launch(op: Op, *tensors: torch.Tensor, inplace: Sequence[int] = (), **params: Any) -> Any:
    """Run ``op`` on ``tensors`` with the kernel for their device (on CUDA, its torch
    code where it has no Numba kernel)."""
    device = check(op, tensors, inplace)
    if device.type == "cuda" and op.cuda is None:
        return op.torch_cuda(*tensors, **params)
    arrays = as_arrays(tensors, device)
    if device.type == "cpu":
        return op.cpu(*arrays, **params)
    return op.cuda(*arrays, stream=torch_stream(), **params)


def blocks(n: int, threads: int = 256) -> tuple[int, int]:
    """A 1D launch configuration covering ``n`` elements."""
    return max(1, (n + threads - 1) // threads), threads


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


PARALLEL_MIN = 1 << 15  # elements below which a CPU kernel runs on one thread (as torch)


def match_torch_threads(elements: int | None = None) -> None:
    """Make this thread's CPU kernels use as many threads as torch does here: a replica
    sets torch's budget to its Dask worker's share of the cores, which numba (all cores
    by default) must not oversubscribe. ``numba.set_num_threads`` is per calling thread.

    With ``elements`` below :data:`PARALLEL_MIN` one thread runs the kernel: waking the
    others costs more than they save, and far more on a busy machine."""
    import numba

    _start_threading_layer()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if elements is not None and elements < PARALLEL_MIN:
        threads = 1
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


@functools.cache
def _start_threading_layer() -> None:
    """Start numba's threading layer once, keeping torch's thread count.

    Numba's ``omp`` layer starts by setting OpenMP's thread count to all the cores, and
    torch shares that OpenMP runtime: without this, a replica's first CPU kernel
    silently moved torch from its worker's share of the cores to all of them. That
    oversubscribed the node and changed the reduction order of torch's kernels, so two
    runs of one seed no longer gave bit-identical weights.
    """
    before = torch.get_num_threads()
    _warm_up(np.zeros(2))
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@njit(parallel=True, cache=False)
def _warm_up(x):  # the smallest parallel kernel: it starts the threading layer
    for i in prange(x.shape[0]):
        x[i] = i


THREADS = 256  # CUDA threads per block
MAX_BLOCKS = 1 << 14  # CUDA grid cap; kernels loop grid-stride over the rest


def one_dtype(op: Op, tensors: Sequence[torch.Tensor]) -> None:
    """Raise OpError unless ``tensors`` share one dtype."""
    if len({t.dtype for t in tensors}) > 1:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        raise OpError(
            f"{op.name}: all tensors must have one dtype, got {', '.join(dtypes)}; "
            "convert them with .to(dtype) first"
        )


def device_tables(arrays: Sequence[Any], device: torch.device) -> list[Any]:
    """Host tables (numpy) and tensors as what ``device``'s kernels take. On CUDA the
    tables go through pinned memory without blocking (a pageable copy would make the
    host wait for the GPU) and torch's caching allocator (numba's allocates each call)."""
    if device.type == "cpu":
        return list(arrays)
    tables = [
        torch.from_numpy(a).pin_memory().to(device, non_blocking=True)
        if isinstance(a, np.ndarray)
        else a
        for a in arrays
    ]
    return [as_arrays([t], device)[0] if isinstance(t, torch.Tensor) else t for t in tables]


def run_kernel(op: Op, device: torch.device, work: int, *arrays: Any, **params: Any) -> Any:
    """Call ``op``'s kernel for ``device`` on ``work`` elements: on the CPU with torch's
    thread budget; on CUDA on torch's current stream (host tables via
    :func:`device_tables`; pass the result of that to skip the copy)."""
    if device.type == "cpu":
        match_torch_threads(work)
        return op.cpu(*arrays, **params)
    return op.cuda(*device_tables(arrays, device), stream=torch_stream(), **params)


def cuda_threads(n: int) -> int:
    """Threads per block for ``n`` work elements: a warp multiple, at most THREADS."""
    return min(THREADS, max(32, -(-n // 32) * 32))


def grid_stride(n: int, stream: Any) -> tuple[int, int, Any]:
    """A grid-stride CUDA launch configuration over ``n`` elements on ``stream``."""
    threads = cuda_threads(n)
    return min(blocks(n, threads)[0], MAX_BLOCKS), threads, stream
