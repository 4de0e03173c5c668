"""How a replica's step computes on its device: precision, memory format, compilation.

The user's request (``Pipeline(precision=..., channels_last=..., compile=...)``) is
validated on the driver where it is built (:func:`check_step_options`); each worker
resolves "auto" against its own device and model (:func:`resolve_step_options`),
since only the worker knows whether it has a GPU that computes in bf16.

Parameters, optimizer state and the allreduce stay fp32 whatever the precision:
autocast only changes the dtype the forward pass and the loss compute in (torch's
autocast keeps reductions and losses such as cross-entropy in fp32). ``"fp16"`` needs a
loss scale that the engine owns (one decision per step from the allreduced gradients,
so every replica keeps the same scale): see :class:`LossScale`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dataflow.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
COMPILE_MODES = (False, True, "default", "max-autotune", "reduce-overhead", "cudagraphs")

__all__ = [
    "COMPILE_MODES",
    "CPU_FP16_ENV",
    "PRECISIONS",
    "SIMULATE_CAPTURE_ENV",
    "LossScale",
    "StepOptions",
    "capture_simulated",
    "check_capture",
    "check_fp16_device",
    "check_step_options",
    "cpu_fp16_allowed",
    "resolve_step_options",
]


# For tests only: lets precision="fp16" run on the CPU (autocast there is many times slower
# than fp32), so the engine's fp16 loss scale can be tested end to end without a GPU
CPU_FP16_ENV = "DATAFLOW_ALLOW_CPU_FP16"


def cpu_fp16_allowed() -> bool:
    """Whether ``DATAFLOW_ALLOW_CPU_FP16=1`` is set in this process (read by the driver,
    which passes it to the workers with the fit)."""
    return os.environ.get(CPU_FP16_ENV) == "1"


# For tests only: capture=True on a CPU worker runs the captured step's bookkeeping
# (static buffers, replays writing into the same tensors) without CUDA
SIMULATE_CAPTURE_ENV = "DATAFLOW_SIMULATE_CAPTURE"


def capture_simulated() -> bool:
    """Whether ``DATAFLOW_SIMULATE_CAPTURE=1`` is set in this process (read by the
    driver, which passes it to the workers with the fit)."""
    return os.environ.get(SIMULATE_CAPTURE_ENV) == "1"


def check_capture(
    capture: Any, *, precision: Any, compile: Any, device: Any, spatial: int, simulate: bool
) -> None:
    """Refuse a ``capture=`` that cannot work, naming the field that conflicts."""
    if not isinstance(capture, bool):
        raise ConfigError(
            f"capture={capture!r}: use True (each steady step's forward and backward "
            "replayed as a CUDA graph) or False (eager)"
        )
    if not capture:
        return
    if str(device).startswith("cpu") and not simulate:
        raise ConfigError(
            "capture=True with device='cpu': CUDA graphs need a CUDA device (the CPU has "
            "no launch overhead to save); use device='auto' or 'cuda', or capture=False"
        )
    if precision == "fp16":
        raise ConfigError(
            "capture=True with precision='fp16': fp16's loss scale changes between steps, "
            "and a captured graph keeps the scale it was captured with; use "
            "precision='bf16' (no loss scale) or capture=False"
        )
    if compile:
        raise ConfigError(
            f"capture=True with compile={compile!r}: pick one. capture=True replays the "
            "eager step as a CUDA graph; compile='reduce-overhead' compiles the model and "
            "replays its graphs through torch.compile"
        )
    if spatial > 1:
        raise ConfigError(
            "capture=True with a spatial layout: the partitioned model exchanges halos "
            "with other workers inside its forward, which a CUDA graph cannot hold; use "
            "capture=False with layout=, or layout=None"
        )


def check_fp16_device(precision: Any, device: Any, *, allowed: bool = False) -> None:
    """Refuse ``precision="fp16"`` on a device that is not CUDA: torch's CPU float16
    autocast has no fast kernels (8 to 30 times slower than fp32 measured here, the
    benchmark's 3-D net 30x), and the loss scale buys nothing there."""
    if precision != "fp16" or allowed or str(device).startswith("cuda") or device == "auto":
        return
    on = "device='cpu'" if isinstance(device, str) else "device='auto' on a worker without a GPU"
    raise ConfigError(
        f"precision='fp16' on the CPU ({on}): torch has no fast float16 kernels there, so "
        "each step runs 8 to 30 times slower than in fp32 (fp16 is for CUDA GPUs, with the "
        "engine's loss scale); use precision='bf16' (the CPU's reduced precision, no loss "
        "scale needed) or 'fp32' (what precision='auto' picks on the CPU)"
    )


def check_step_options(precision: Any, channels_last: Any, compile: Any) -> None:
    """Raise a ConfigError naming the field and the accepted values."""
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision={precision!r}: use 'auto' (bf16 on a GPU that supports it, fp32 "
            "on the CPU), 'bf16', 'fp16' (CUDA only, with a loss scale the engine keeps) or 'fp32'"
        )
    if channels_last not in (True, False, "auto"):
        raise ConfigError(
            f"channels_last={channels_last!r}: use 'auto' (on CUDA for models with 2-D or "
            "3-D convolutions), True or False"
        )
    if isinstance(compile, bool):
        return
    if compile not in COMPILE_MODES:
        modes = ", ".join(repr(m) for m in COMPILE_MODES if not isinstance(m, bool))
        raise ConfigError(
            f"compile={compile!r}: use False (eager), True (torch.compile's default mode) "
            f"or one of {modes}"
        )


@dataclass(frozen=True)
class StepOptions:
    """What one worker's step does, resolved against its device and model."""

    precision: str = "fp32"  # "bf16", "fp16" or "fp32"
    memory_format: str | None = None  # "channels_last", "channels_last_3d" or None
    compile: str | None = None  # a torch.compile mode, "cudagraphs", or None (eager)
    # steady steps replayed as CUDA graphs (stages/capture.py): "cuda", "simulated"
    # (tests on the CPU), or None (eager)
    capture: str | None = None

    @property
    def autocast(self) -> bool:
        return self.precision != "fp32"

    def autocast_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self.precision == "bf16" else torch.float16

    def torch_memory_format(self) -> torch.memory_format | None:
        import torch

        if self.memory_format is None:
            return None
        return getattr(torch, self.memory_format)

    def describe(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "memory_format": self.memory_format or "contiguous",
            "compile": self.compile or "eager",
            "capture": self.capture or "off",
        }


def _conv_dims(model: torch.nn.Module) -> set[int]:
    """Spatial dimensions of the model's convolutions (2 for Conv2d, 3 for Conv3d)."""
    import torch

    dims = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d | torch.nn.ConvTranspose2d):
            dims.add(2)
        elif isinstance(module, torch.nn.Conv3d | torch.nn.ConvTranspose3d):
            dims.add(3)
    return dims


def resolve_step_options(
    precision: str,
    channels_last: bool | str,
    compile: bool | str,
    device: torch.device,
    model: torch.nn.Module,
    *,
    spatial: bool = False,
    allow_cpu_fp16: bool = False,
    capture: bool = False,
    simulate_capture: bool = False,
) -> StepOptions:
    """ "auto" made concrete for this worker: bf16 where CUDA supports it, else fp32 (never
    fp16, which is refused off CUDA unless ``allow_cpu_fp16``: tests only); channels_last
    on CUDA for a model whose convolutions are all 2-D (or all 3-D); never for a spatial
    layout (its halo exchange slices contiguous NCHW tensors); captured steps on CUDA
    (or simulated, ``simulate_capture``: tests only), eager on a worker without a GPU."""
    import torch

    cuda = device.type == "cuda"
    check_fp16_device(precision, device, allowed=allow_cpu_fp16)
    if precision == "auto":
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    dims = _conv_dims(model)
    memory_format = None
    wanted = channels_last is True or (channels_last == "auto" and cuda)
    if wanted and len(dims) == 1 and not spatial:
        memory_format = "channels_last" if dims == {2} else "channels_last_3d"
    elif channels_last is True and spatial:
        raise ConfigError(
            "channels_last=True with a spatial layout: the halo exchange slices contiguous "
            "tensors; leave channels_last='auto' (off for spatial layouts) or False"
        )
    elif channels_last is True:
        raise ConfigError(
            f"channels_last=True but the model's convolutions are "
            f"{'absent' if not dims else 'of mixed dimensions'}: channels_last applies to "
            "models of Conv2d (or of Conv3d) layers; leave channels_last='auto' or False"
        )
    mode = None
    if compile is True:
        mode = "default"
    elif compile:
        mode = str(compile)
    if mode == "cudagraphs" and not cuda:
        raise ConfigError(
            "compile='cudagraphs' on the CPU: CUDA graphs need a CUDA device; use "
            "compile=True on the CPU"
        )
    captured = None
    if capture and cuda:
        captured = "cuda"
    elif capture and simulate_capture:
        captured = "simulated"
    return StepOptions(
        precision=precision, memory_format=memory_format, compile=mode, capture=captured
    )


@dataclass
class LossScale:
    """fp16's dynamic loss scale, kept alike on every replica.

    The loss is multiplied by ``scale`` before backward; the allreduce divides it out
    (it already weights each replica's gradient), so everything after it sees unscaled
    gradients. A step whose reduced gradient overflowed is skipped and the scale
    halved; after ``growth_interval`` good steps in a row it doubles. The decision reads
    the reduced gradient, identical on every replica, so the scales never diverge; the
    state is part of each commit and checkpoint.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    min_scale: float = 1.0

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
