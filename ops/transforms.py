"""Data-path ops: Log1p, Standardize, RandomFlip, RandomRotate90.

Each is a small frozen config whose ``__call__(x)`` maps a batch tensor ``[N, C, ...]``
to a new tensor on the same device, so it works as a ``stages.Transform`` function and
from user code. The cast to the training dtype (``dtype=``) is fused into the kernel:
the output is written in that dtype directly, with no separate ``.to()`` pass.

Dtypes: float16, float32, float64 and the integer types uint8, int8, int16, int32,
int64 as input; Log1p and Standardize write a float dtype (default: the input's, or
torch's default dtype for integer input, as ``torch.log1p`` does). bfloat16 is refused
(numba has no bfloat16). Arithmetic runs in float32, or float64 when the input or the
output is float64, and is rounded once to the output dtype. Non-contiguous inputs are
copied to contiguous ones first (by ``registry.launch``). CPU kernels run on as many
threads as ``torch.get_num_threads()`` (a replica's share of its node). Outputs come
from ``torch.empty``: a large CPU one (32 MiB and more is a fresh mmap from glibc) costs
more in first-touch page faults than the kernel's own work, unless torch allocates on
transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``).

The random ops draw their per-sample choices on the host from
``numpy.random.default_rng(seed)`` (:func:`draw_flips`, :func:`draw_rotations`) and one
kernel applies them; ``wants_seed = True`` makes ``stages.Transform`` pass
``seed=(fit seed, step, replica rank)``, so runs are reproducible.

On CUDA tensors Log1p and Standardize run Numba CUDA kernels; RandomFlip and
RandomRotate90 run torch code (``ops/transform_torch.py``, where the measurements that
decided it are), equal bit for bit to their CPU kernels for the same choices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from dataflow.core.errors import ConfigError
from dataflow.ops import transform_kernels as kernels
from dataflow.ops.registry import Op, OpError, launch, register
from dataflow.ops.transform_torch import flip_torch, rot90_torch

FLOATS = (torch.float16, torch.float32, torch.float64)
INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
SUPPORTED = FLOATS + INTEGERS


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _compute(x: torch.dtype, out: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in (x, out) else torch.float32


# -- references: the plain torch definitions the kernels are tested against -------------


def log1p_reference(x: torch.Tensor, *, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.log1p(x.to(_compute(x.dtype, dtype)) * scale).to(dtype)


def standardize_reference(
    x: torch.Tensor, *, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype
) -> torch.Tensor:
    ct = _compute(x.dtype, dtype)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    m = torch.tensor(mean, dtype=ct, device=x.device).reshape(shape)
    s = torch.tensor(std, dtype=ct, device=x.device).reshape(shape)
    return ((x.to(ct) - m) / s).to(dtype)


def flip_reference(
    x: torch.Tensor, *, flags: np.ndarray, axes: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """``flags[n, i]``: flip sample ``n`` along ``axes[i]`` (a batch axis, ≥ 2)."""
    samples = [
        torch.flip(x[n], [a - 1 for a, f in zip(axes, flags[n], strict=True) if f])
        for n in range(len(x))
    ]
    return torch.stack(samples).to(dtype) if samples else x.to(dtype)


def rot90_reference(
    x: torch.Tensor, *, ks: np.ndarray, axes: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """Sample ``n`` is ``torch.rot90(x[n], ks[n], dims=axes)`` (in batch-axis numbering)."""
    dims = (axes[0] - 1, axes[1] - 1)
    samples = [torch.rot90(x[n], int(ks[n]), dims) for n in range(len(x))]
    return torch.stack(samples).to(dtype) if samples else x.to(dtype)


LOG1P = register(Op("Log1p", kernels.log1p_cpu, kernels.log1p_cuda, log1p_reference, SUPPORTED))
STANDARDIZE = register(
    Op(
        "Standardize",
        kernels.standardize_cpu,
        kernels.standardize_cuda,
        standardize_reference,
        SUPPORTED,
    )
)
FLIP = register(
    Op("RandomFlip", kernels.flip_cpu, None, flip_reference, SUPPORTED, torch_cuda=flip_torch)
)
ROT90 = register(
    Op(
        "RandomRotate90",
        kernels.rot90_cpu,
        None,
        rot90_reference,
        SUPPORTED,
        torch_cuda=rot90_torch,
    )
)


# -- random choices (host side, reusable by tests and references) ----------------------


def _rng(op: str, seed: Any) -> np.random.Generator:
    """``seed``: None (fresh entropy), a non-negative int, or a tuple of them."""
    parts = seed if isinstance(seed, tuple | list) else (seed,)
    if seed is not None and not all(
        isinstance(s, int | np.integer) and not isinstance(s, bool) and s >= 0 for s in parts
    ):
        raise ConfigError(
            f"{op}(x, seed={seed!r}): seed must be None, a non-negative int or a tuple of "
            "them, e.g. seed=(fit_seed, step, rank)"
        )
    return np.random.default_rng(None if seed is None else [int(s) for s in parts])


def draw_flips(n: int, axes: int, p: float, seed: Any) -> np.ndarray:
    """Bool ``[n, axes]``: flip sample ``n`` along its ``i``-th axis, each with probability p."""
    return _rng("RandomFlip", seed).random((n, axes)) < p


def draw_rotations(n: int, seed: Any) -> np.ndarray:
    """Int64 ``[n]``: quarter turns per sample, uniform in 0..3."""
    return _rng("RandomRotate90", seed).integers(0, 4, size=n, dtype=np.int64)


# -- validation helpers ----------------------------------------------------------------


def _check_dtype(op: str, dtype: Any, allowed: Sequence[torch.dtype]) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"{op}(dtype={dtype!r}): expected a torch.dtype such as torch.float32, or None "
            "to keep the input's dtype"
        )
    if dtype not in allowed:
        raise OpError(
            f"{op}(dtype={dtype}): output dtype {dtype} is not supported; "
            f"supported: {_names(allowed)}"
        )


def _out_dtype(x: torch.Tensor, dtype: torch.dtype | None, floating: bool) -> torch.dtype:
    if dtype is not None:
        return dtype
    if floating and not x.dtype.is_floating_point and x.dtype in SUPPORTED:
        return torch.get_default_dtype()
    return x.dtype


def _tensor(op: str, x: Any, min_ndim: int, max_ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise OpError(
            f"{op}: expected a torch.Tensor, got {type(x).__name__}; "
            "wrap numpy arrays with torch.from_numpy(array)"
        )
    if x.ndim < min_ndim or (max_ndim is not None and x.ndim > max_ndim):
        most = f"..{max_ndim}" if max_ndim is not None else "+"
        raise OpError(
            f"{op}: expected a batch [N, C, ...] with {min_ndim}{most} dims, got shape "
            f"{tuple(x.shape)}; add the sample and channel axes, e.g. x[None, None]"
        )
    return x


def _axes(op: str, axes: Any, count: int | None) -> tuple[int, ...]:
    try:
        values = tuple(int(a) for a in axes)
        ok = all(isinstance(a, int | np.integer) and not isinstance(a, bool) for a in axes)
    except TypeError:
        ok = False
    if not ok or len(values) == 0 or min(values) < 2 or len(set(values)) != len(values):
        raise ConfigError(
            f"{op}(axes={axes!r}): expected distinct batch axes ≥ 2 (axis 0 is the sample, "
            "1 the channel), e.g. axes=(2, 3) for [N, C, H, W]"
        )
    if count is not None and len(values) != count:
        raise ConfigError(
            f"{op}(axes={axes!r}): expected exactly {count} axes, the plane to rotate in, "
            "e.g. axes=(2, 3)"
        )
    return values


def _check_axes_fit(op: str, axes: tuple[int, ...], x: torch.Tensor) -> None:
    if max(axes) >= x.ndim:
        raise OpError(
            f"{op}: axes {axes} do not exist in a tensor of shape {tuple(x.shape)}; "
            f"pick axes in 2..{x.ndim - 1}"
        )


def _number(op: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ConfigError(f"{op}({field}={value!r}): expected a number")
    if not math.isfinite(float(value)):
        raise ConfigError(f"{op}({field}={value!r}): expected a finite number")
    return float(value)


def _positive(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(f"Standardize.fit({field}={value!r}): expected a positive int")
    return int(value)


def _channel_moments(
    source: Any, *, samples: int, seed: Any, batch: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and population std of ``x`` over a random subset of ``source``.

    Batches are combined with Chan et al.'s pairwise update in float64: numerically as
    good as one pass, in the memory of one batch.
    """
    samples, batch = _positive("samples", samples), _positive("batch", batch)
    if not hasattr(source, "read") or not hasattr(source, "num_samples"):
        raise ConfigError(
            f"Standardize.fit(source={type(source).__name__}): expected a source with "
            "num_samples and read(indices), e.g. dataflow.io.ArraySource or ZarrSource"
        )
    total = int(source.num_samples)
    rng = _rng("Standardize.fit", seed)
    picked = np.sort(rng.choice(total, size=min(samples, total), replace=False))
    count, mean, m2 = 0, None, None
    for start in range(0, len(picked), batch):
        x = source.read(picked[start : start + batch]).x
        if not isinstance(x, torch.Tensor) or x.ndim < 2:
            raise ConfigError(
                "Standardize.fit: the source's x must be one tensor [N, C, ...] per batch, got "
                f"{type(x).__name__}; with several x variables, standardise each separately"
            )
        x = x.detach().to("cpu", torch.float64).reshape(x.shape[0], x.shape[1], -1)
        n = x.shape[0] * x.shape[2]
        bmean = x.mean(dim=(0, 2))
        bm2 = ((x - bmean[None, :, None]) ** 2).sum(dim=(0, 2))
        if mean is None:
            count, mean, m2 = n, bmean, bm2
        else:
            delta = bmean - mean
            mean = mean + delta * (n / (count + n))
            m2 = m2 + bm2 + delta**2 * (count * n / (count + n))
            count += n
    assert mean is not None and m2 is not None
    std = torch.sqrt(m2 / max(count, 1))
    bad = [c for c in range(len(std)) if not (math.isfinite(std[c]) and std[c] > 0)]
    if bad or not bool(torch.isfinite(mean).all()):
        raise ConfigError(
            f"Standardize.fit: channel(s) {bad or 'some'} have std {std.tolist()} and mean "
            f"{mean.tolist()} over {len(picked)} samples: constant or non-finite data; fix "
            "the data or pass Standardize(mean=..., std=...) explicitly"
        )
    return tuple(mean.tolist()), tuple(std.tolist())


# -- the ops ---------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class Log1p:
    """``log1p(scale * x)``: compresses the range of density-like fields.

    Like ``torch.log1p`` at the edge of the domain: ``-inf`` where ``scale * x == -1``,
    ``nan`` below it and for nan input, ``+inf`` for ``+inf``.
    """

    scale: float = 1.0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", _number("Log1p", "scale", self.scale))
        _check_dtype("Log1p", self.dtype, FLOATS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _tensor("Log1p", x, 1)
        out = torch.empty(x.shape, dtype=_out_dtype(x, self.dtype, True), device=x.device)
        launch(LOG1P, x, out, scale=self.scale)
        return out


@dataclass(kw_only=True, frozen=True)
class Standardize:
    """``(x - mean[c]) / std[c]`` per channel (axis 1); :meth:`fit` measures mean and std."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        values = {}
        for field in ("mean", "std"):
            raw = getattr(self, field)
            raw = raw.tolist() if hasattr(raw, "tolist") else raw  # numpy, torch
            raw = (raw,) if isinstance(raw, int | float | np.number) else raw
            try:
                values[field] = tuple(_number("Standardize", field, v) for v in raw)
            except TypeError:
                raise ConfigError(
                    f"Standardize({field}={raw!r}): expected one number per channel"
                ) from None
            object.__setattr__(self, field, values[field])
        if not values["mean"] or len(values["mean"]) != len(values["std"]):
            raise ConfigError(
                f"Standardize: mean has {len(self.mean)} values and std {len(self.std)}; "
                "pass one mean and one std per channel (or use Standardize.fit(source))"
            )
        bad = [c for c, s in enumerate(self.std) if s <= 0]
        if bad:
            raise ConfigError(
                f"Standardize(std={self.std}): std must be > 0, channel(s) {bad} are not; "
                "a constant channel cannot be standardised: drop it or pass std=1 for it"
            )
        _check_dtype("Standardize", self.dtype, FLOATS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _tensor("Standardize", x, 2)
        if x.shape[1] != len(self.mean):
            raise OpError(
                f"Standardize: x has {x.shape[1]} channels (axis 1 of shape "
                f"{tuple(x.shape)}) but mean/std have {len(self.mean)}; pass one mean and "
                "std per channel, e.g. Standardize.fit(source) on the same data"
            )
        out = torch.empty(x.shape, dtype=_out_dtype(x, self.dtype, True), device=x.device)
        launch(STANDARDIZE, x, out, mean=self.mean, std=self.std)
        return out

    @classmethod
    def fit(
        cls,
        source: Any,
        *,
        samples: int = 1024,
        seed: Any = 0,
        batch: int = 64,
        dtype: torch.dtype | None = None,
    ) -> Standardize:
        """Per-channel mean and std over ``samples`` random samples of ``source``.

        Reads ``batch`` samples at a time (bounded memory) and combines the moments in
        float64, so the statistics match one pass over all the samples.
        """
        mean, std = _channel_moments(source, samples=samples, seed=seed, batch=batch)
        return cls(mean=mean, std=std, dtype=dtype)

    @classmethod
    def from_stats(
        cls, stats: Any, source: Any = None, *, dtype: torch.dtype | None = None
    ) -> Standardize:
        """From statistics measured once over a store (``dfl.io.normalization_stats``):
        per channel of ``source``'s x (its variables' statistics repeated over the dims
        it folds into channels), or one channel per variable without a source."""
        mean, std = stats.per_channel(source)
        return cls(mean=mean, std=std, dtype=dtype)


@dataclass(kw_only=True, frozen=True)
class RandomFlip:
    """Flip each sample along each of ``axes`` with probability ``p`` (2D or 3D samples)."""

    axes: tuple[int, ...] = (2, 3)
    p: float = 0.5
    dtype: torch.dtype | None = None
    wants_seed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", _axes("RandomFlip", self.axes, None))
        p = _number("RandomFlip", "p", self.p)
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"RandomFlip(p={self.p!r}): p is a probability, in [0, 1]")
        object.__setattr__(self, "p", p)
        _check_dtype("RandomFlip", self.dtype, SUPPORTED)

    def choices(self, n: int, seed: Any = None) -> np.ndarray:
        """What ``__call__`` draws for ``n`` samples: bool ``[n, len(axes)]``."""
        return draw_flips(n, len(self.axes), self.p, seed)

    def __call__(self, x: torch.Tensor, seed: Any = None) -> torch.Tensor:
        x = _tensor("RandomFlip", x, 3, 5)
        _check_axes_fit("RandomFlip", self.axes, x)
        drawn = self.choices(len(x), seed)
        flags = np.zeros((len(x), 3), dtype=np.uint8)  # D, H, W of the sample as [C, D, H, W]
        pad = 5 - x.ndim
        for i, axis in enumerate(self.axes):
            flags[:, axis + pad - 2] = drawn[:, i]
        shape5 = (x.shape[0], x.shape[1]) + (1,) * pad + tuple(x.shape[2:])
        out = torch.empty(x.shape, dtype=_out_dtype(x, self.dtype, False), device=x.device)
        launch(FLIP, x.reshape(shape5), out.view(shape5), flags=flags)
        return out


@dataclass(kw_only=True, frozen=True)
class RandomRotate90:
    """Rotate each sample by k·90° in the plane of ``axes``, k uniform in 0..3.

    Sample ``n`` becomes ``torch.rot90(x[n], k, dims)`` (``axes`` in batch numbering);
    the two axes must have equal sizes, since odd k swaps them.
    """

    axes: tuple[int, int] = (2, 3)
    dtype: torch.dtype | None = None
    wants_seed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", _axes("RandomRotate90", self.axes, 2))
        _check_dtype("RandomRotate90", self.dtype, SUPPORTED)

    def choices(self, n: int, seed: Any = None) -> np.ndarray:
        """What ``__call__`` draws for ``n`` samples: quarter turns, int64 ``[n]``."""
        return draw_rotations(n, seed)

    def __call__(self, x: torch.Tensor, seed: Any = None) -> torch.Tensor:
        x = _tensor("RandomRotate90", x, 4)
        _check_axes_fit("RandomRotate90", self.axes, x)
        a, b = sorted(self.axes)
        if x.shape[a] != x.shape[b]:
            raise OpError(
                f"RandomRotate90: axes {self.axes} of shape {tuple(x.shape)} have sizes "
                f"{x.shape[a]} and {x.shape[b]}; a quarter turn swaps them, so they must be "
                "equal: crop or pad to a square, or rotate in another plane"
            )
        ks = self.choices(len(x), seed)
        if self.axes[0] > self.axes[1]:  # the kernel turns from the lower axis to the higher
            ks = (4 - ks) % 4
        s = x.shape
        shape7 = (s[0], s[1], math.prod(s[2:a]), s[a], math.prod(s[a + 1 : b]), s[b])
        shape7 += (math.prod(s[b + 1 :]),)
        out = torch.empty(x.shape, dtype=_out_dtype(x, self.dtype, False), device=x.device)
        launch(ROT90, x.reshape(shape7), out.view(shape7), ks=ks)
        return out
