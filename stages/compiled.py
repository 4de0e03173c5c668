"""The forward pass's settings on the device: autocast, memory format, torch.compile.

Forward resolves the user's ``precision``/``channels_last``/``compile`` into a
:class:`~dataflow.core.precision.StepOptions` once per fit and applies them here each
step, so the eager fp32 step (the default on the CPU) pays nothing for them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from dataflow.core.precision import StepOptions

EAGER_FP32 = StepOptions()


def autocast(
    device: torch.device, options: StepOptions, *, cache_enabled: bool = True
) -> contextlib.AbstractContextManager:
    """torch.autocast in the options' dtype on ``device``; a no-op context for fp32.
    ``cache_enabled=False`` inside a CUDA graph capture (torch's rule: the weights' cast
    copies must be made inside the graph, not kept from before it)."""
    if not options.autocast:
        return contextlib.nullcontext()
    return torch.autocast(
        device_type=device.type, dtype=options.autocast_dtype(), cache_enabled=cache_enabled
    )


def to_memory_format(x: Any, memory_format: torch.memory_format | None) -> Any:
    """The batch in the model's memory format (4-D tensors for channels_last, 5-D for
    channels_last_3d); other inputs, and any input without a format, as they are."""
    if memory_format is None:
        return x
    if isinstance(x, tuple):
        return tuple(to_memory_format(v, memory_format) for v in x)
    rank = 4 if memory_format == torch.channels_last else 5
    if isinstance(x, torch.Tensor) and x.ndim == rank:
        return x.contiguous(memory_format=memory_format)
    return x


class CompiledModel:
    """``torch.compile`` of a replica's model, compiled on the first call of each input
    shape and reused after: a phase has one local batch, so a fit sees few shapes (the
    epoch's last, shorter step and a last micro-batch add one each; after a second
    shape torch compiles a graph dynamic in the batch dimension, which covers the rest).

    The wrapper shares the model's parameters, so commits, checkpoints and the
    allreduce see the plain model. Each phase reports the seconds spent in calls that
    compiled (a new shape) and how many there were.
    """

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        if mode == "cudagraphs":
            self._module = torch.compile(model, backend="cudagraphs")
        else:
            self._module = torch.compile(model, mode=None if mode == "default" else mode)
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._seen: set[tuple[Any, ...]] = set()
        self._seconds = 0.0
        self._compiles = 0

    def _shape_key(self, x: Any) -> tuple[Any, ...]:
        values = x if isinstance(x, tuple) else (x,)
        return tuple(
            (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in values
        )

    def __call__(self, x: Any) -> Any:
        key = self._shape_key(x)
        if key in self._seen:
            return self._module(*x) if isinstance(x, tuple) else self._module(x)
        started = time.perf_counter()
        output = self._module(*x) if isinstance(x, tuple) else self._module(x)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._seconds += time.perf_counter() - started
        self._compiles += 1
        self._seen.add(key)
        return output

    def phase_report(self) -> dict[str, Any]:
        report = {"compile_seconds": self._seconds, "compiled_shapes": self._compiles}
        self._seconds, self._compiles = 0.0, 0
        return report
