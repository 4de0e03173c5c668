"""Captured steps: a steady step's forward, loss and backward as one CUDA graph.

On a GPU, a step of a small or medium CNN is bound by the host: Python launches its
hundreds of kernels more slowly than the GPU runs them, so the GPU waits. A CUDA graph
records the kernels of one step once and replays them with a single launch.

What is captured: the model's forward, the loss, and the gradients of the parameters
(``torch.autograd.grad``: no gradient hooks run, in the capture or in a replay), for one
input shape: a phase has one local batch, so a phase needs one graph; its last, shorter
step adds one. With micro-batches (gradient accumulation) each micro-batch is replayed:
the first one's graph writes the gradients into buffers the phase's micro-batch graphs
share, the others' add to them (never onto gradients an eager first micro-batch left:
then the step accumulates eagerly). Empty batches run eagerly. Everything after the gradients (the
allreduce, the optimizer, the non-finite check, the noise scale) stays eager and reads
the gradient tensors the replays write: the same tensors at every replay, attached to
the parameters again after each one, since an optimizer's ``zero_grad`` drops them.

Each shape runs eagerly :data:`WARMUP` times first (cuDNN picks its algorithms there,
which it cannot do inside a capture); then it is captured. A capture that fails (a
model that reads a value on the host, or calls what a graph cannot hold) leaves that
shape eager for the rest of the fit, with the reason in the phase's statistics and a
warning. What a captured step needs of the model and the loss: the same GPU work every
step, no host reads, no Python decisions on the data's values.

The inputs are copied into static buffers before each replay (one copy on the device);
the captured loss and output are overwritten by the next replay, so the loss handed on
is a copy. For tests without a GPU, ``simulate=True`` runs the same bookkeeping on the
CPU: the capture computes the step once into the static tensors, and each "replay"
computes it again and writes the results into those same tensors.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.core.precision import StepOptions
from dataflow.stages.base import Batch, StepContext
from dataflow.stages.compiled import autocast, to_memory_format

WARMUP = 2  # eager steps of a shape before it is captured
MAX_SHAPES = 8  # graphs kept per phase (a shape's, its micro-batches' variants)

__all__ = ["MAX_SHAPES", "WARMUP", "StepCapture"]


@dataclass
class _Captured:
    """One input shape's graph and the tensors it reads and writes."""

    x: Any  # static inputs, filled before each replay
    y: Any
    loss: torch.Tensor  # written by each replay
    output: Any
    grads: list[torch.Tensor | None]  # per trainable parameter, as the model lists them
    replay: Callable[[], None]


class StepCapture:
    """A replica's captured steps, one graph per input shape (see the module docstring).

    ``compute(x, y) -> (loss, output)`` is Forward's forward and loss, without its
    checks (the warm-up steps ran them eagerly, on the same shapes)."""

    def __init__(
        self,
        model: torch.nn.Module,
        compute: Callable[[Any, Any], tuple[torch.Tensor, Any]],
        options: StepOptions,
        device: torch.device,
        *,
        simulate: bool = False,
    ) -> None:
        self._model = model
        self._compute = compute
        self._options = options
        self._device = device
        self._simulate = simulate
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._tensors = [*model.parameters(), *model.buffers()]
        self._graphs: dict[tuple[Any, ...], _Captured] = {}
        self._seen: dict[tuple[Any, ...], int] = {}
        self._failed: dict[tuple[Any, ...], str] = {}
        self._recorded: tuple[int, ...] = ()
        self._checked: Any = None  # the window whose addresses were checked
        self._shared: list[torch.Tensor] | None = None  # the micro-batches' gradients
        self._whole = True  # every micro-batch of the running step replayed so far
        self._pool: Any = None  # the phase's graphs' memory pool (CUDA)
        self._seconds = 0.0
        self._captures = 0
        self._replays = 0
        self._moved = 0

    def reset(self) -> None:
        """Drop every graph (their memory with them) and warm up again: at each phase's
        start, whose local batch is new, so a phase keeps only its own graphs."""
        self._graphs.clear()
        self._seen.clear()
        self._shared = None
        self._pool = None

    def _addresses(self) -> tuple[int, ...]:
        """Where the weights and buffers live: a graph reads them there. Everything the
        engine does to them (rollbacks, averages, broadcasts) writes in place; a change
        (``module.to``, a ``p.data`` replaced) drops the graphs instead of training on
        memory the model no longer uses."""
        return tuple(t.data_ptr() for t in self._tensors)  # (ResNet-50: ~30 us)

    def run(self, step: StepContext, batch: Batch) -> tuple[torch.Tensor, Any] | None:
        """This step's (micro-batch's) ``(loss, output)`` from a graph replay, its
        gradients on the parameters (accumulated over micro-batches); None when it runs
        eagerly (a shape still warming up, an fp16 loss scale, inputs that are not
        tensors). A step counts as replayed when every micro-batch of it was."""
        if step.micro_index == 0:
            self._whole = True
        replayed = self._run(step, batch)
        if replayed is None:
            self._whole = False
        elif step.last_micro_batch and self._whole:
            self._replays += 1
        return replayed

    def _run(self, step: StepContext, batch: Batch) -> tuple[torch.Tensor, Any] | None:
        if batch.size == 0 or step.replica.loss_scale is not None:
            return None
        if not self._model.training:  # graphs hold the training mode they were captured in
            return None
        shape = _shape_key(batch.x, batch.y)
        if shape is None:
            return None
        # micro-batches (gradient accumulation): the loss weighted by the micro-batch's
        # share, the gradients written (the first) or added (the others) into buffers
        # every micro-batch's graph shares; the others only onto what the first wrote
        micro = step.micro_count > 1
        adds = micro and step.micro_index > 0
        key = (shape, step.micro_weight, micro, adds)
        if self._graphs and step.replica.window is not self._checked:
            # once per window: the engine changes weights in place, between windows
            self._checked = step.replica.window
            if self._addresses() != self._recorded:
                self.reset()  # weights or buffers moved: the graphs would read old memory
                self._moved += 1
        captured = self._graphs.get(key)
        if captured is None:
            if key in self._failed or len(self._graphs) >= MAX_SHAPES:
                return None
            self._seen[key] = seen = self._seen.get(key, 0) + 1
            if seen <= WARMUP:
                return None
        if adds and not self._holds_shared_grads():
            return None  # an earlier micro-batch ran eagerly: accumulate eagerly too
        if captured is None:
            captured = self._capture(key, batch)
            if captured is None:
                return None
        else:
            _fill(captured.x, batch.x)
            _fill(captured.y, batch.y)
            captured.replay()
        for param, grad in zip(self._params, captured.grads, strict=True):
            if grad is not None and param.grad is not grad:
                param.grad = grad
        return captured.loss.clone(), captured.output

    def _holds_shared_grads(self) -> bool:
        """Whether the parameters' gradients are the micro-batch graphs' buffers (an
        earlier micro-batch of this step was replayed and wrote them)."""
        if self._shared is None:
            return False
        held = [
            p.grad is s
            for p, s in zip(self._params, self._shared, strict=True)
            if p.grad is not None
        ]
        return bool(held) and all(held)

    def _gradients(
        self, x: Any, y: Any, key: tuple[Any, ...]
    ) -> tuple[torch.Tensor, Any, list[Any]]:
        """One step's (micro-batch's) loss, output and parameter gradients, as a graph
        records them; for a micro-batch, the loss weighted by its share and the gradients
        written or added into the shared buffers (which the parameters then get)."""
        _, weight, micro, adds = key
        with autocast(self._device, self._options, cache_enabled=False):
            loss, output = self._compute(x, y)
            if micro:
                loss = loss * weight
        grads = list(torch.autograd.grad(loss, self._params, allow_unused=True))
        if micro:  # (a parameter the loss does not use keeps no gradient, as eagerly)
            pairs = [(s, g) for s, g in zip(self._shared, grads, strict=True) if g is not None]
            into, new = [s for s, _ in pairs], [g for _, g in pairs]
            with torch.no_grad():
                if adds:
                    torch._foreach_add_(into, new)
                else:
                    torch._foreach_copy_(into, new)
            grads = [s if g is not None else None for s, g in zip(self._shared, grads, strict=True)]
        return loss.detach(), _detach(output), grads

    def _capture(self, key: tuple[Any, ...], batch: Batch) -> _Captured | None:
        """Record the step for ``key``'s shape and run it once (this step's result)."""
        started = time.perf_counter()
        memory_format = self._options.torch_memory_format()
        x = _static_copy(to_memory_format(batch.x, memory_format))
        y = _static_copy(batch.y)
        if key[2] and self._shared is None:  # micro-batches: the gradient buffers they share
            self._shared = [torch.zeros_like(p) for p in self._params]
        try:
            record = self._record_simulated if self._simulate else self._record_cuda
            captured = record(x, y, key)
        except Exception as exc:  # the model or loss cannot be captured: eager from now
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._failed[key] = reason
            warnings.warn(
                f"capture=True: the step for input shape {_describe(key[0])} could not be "
                f"captured as a CUDA graph ({reason}); it runs eagerly. A captured step "
                "needs a model and loss that do the same GPU work every step, without host "
                "reads (.item(), printing tensors) or Python decisions on the data",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        self._graphs[key] = captured
        self._recorded = self._addresses()
        self._captures += 1
        self._seconds += time.perf_counter() - started
        return captured

    def _record_cuda(self, x: Any, y: Any, key: tuple[Any, ...]) -> _Captured:
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # the replica's GPU, whichever this task thread's current device is; one memory
        # pool for the phase's graphs, so a micro-batch's variants do not each hold the
        # activations' memory (a graph may reuse another's intermediates, and a replay
        # may overwrite another graph's outputs: each graph's outputs are read right
        # after its own replay, the loss copied, the micro-batches' gradients summed
        # in buffers outside the pool); thread_local: the loader thread keeps copying
        # the next batches meanwhile
        with (
            torch.cuda.device(self._device),
            torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"),
        ):
            loss, output, grads = self._gradients(x, y, key)
        graph.replay()  # the capture only recorded: this computes the step
        torch.cuda.synchronize(self._device)  # the capture's time, once per shape
        return _Captured(x, y, loss, output, grads, graph.replay)

    def _record_simulated(self, x: Any, y: Any, key: tuple[Any, ...]) -> _Captured:
        loss, output, grads = self._gradients(x, y, key)

        def replay() -> None:  # new values into the recorded tensors, as a replay writes
            new_loss, new_output, new_grads = self._gradients(x, y, key)
            with torch.no_grad():
                loss.copy_(new_loss)
                _copy_into(output, new_output)
                for grad, new in zip(grads, new_grads, strict=True):
                    if grad is not None and grad is not new:  # (shared: written already)
                        grad.copy_(new)

        return _Captured(x, y, loss, output, grads, replay)

    def phase_report(self) -> dict[str, Any]:
        """Seconds spent capturing in the phase, the shapes captured, the steps that ran as
        a replay; the reasons of failed captures (cleared: each phase reports its own)."""
        report: dict[str, Any] = {
            "capture_seconds": self._seconds,
            "captured_shapes": self._captures,
            "captured_steps": self._replays,
        }
        if self._failed:
            report["capture_failures"] = sorted(set(self._failed.values()))
        if self._moved:
            report["capture_failures"] = [
                *report.get("capture_failures", ()),
                f"the model's weights or buffers moved in memory {self._moved} time(s); "
                "its graphs were captured again",
            ]
        self._seconds, self._captures, self._replays, self._moved = 0.0, 0, 0, 0
        return report


def _shape_key(x: Any, y: Any) -> tuple[Any, ...] | None:
    """What a graph is specific to: each input's shape, dtype, strides and device; None
    when an input is neither a tensor, a tuple of tensors nor (for y) None."""
    parts = []
    for value in (x, y):
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, torch.Tensor):
                parts.append((tuple(v.shape), v.dtype, v.stride(), str(v.device)))
            elif v is None and value is y:
                parts.append(None)
            else:
                return None
    return tuple(parts)


def _describe(key: tuple[Any, ...]) -> str:
    return ", ".join("none" if part is None else str(part[0]) for part in key)


def _static_copy(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_static_copy(v) for v in value)
    return value.clone() if isinstance(value, torch.Tensor) else value


def _fill(static: Any, value: Any) -> None:
    """Copy a batch into the graph's input buffers (converting the memory format)."""
    if isinstance(static, tuple):
        for s, v in zip(static, value, strict=True):
            _fill(s, v)
    elif isinstance(static, torch.Tensor):
        static.copy_(value)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _copy_into(static: Any, value: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(value)
    elif isinstance(static, tuple | list):
        for s, v in zip(static, value, strict=True):
            _copy_into(s, v)
    elif isinstance(static, dict):
        for k, s in static.items():
            _copy_into(s, value[k])
