"""FusedLARS and FusedLAMB: layer-wise adaptive optimizers for large global batches.

Growing the batch (``Stepwise``, ``Adaptive``) and scaling the LR with it works up to
a point; past a few thousand samples a step, one LR for every layer is too large for
some layers and too small for others, and training diverges or loses accuracy. LARS
(You, Gitman and Ginsburg 2017) and LAMB (You et al. 2019) scale each tensor's update
by a *trust ratio* of its weight norm to its update norm, which is how ResNet-50 was
trained at batch 32k (LARS) and how MLPerf HPC's DeepCAM climate segmentation trains
(LAMB). torch has neither.

Both are :class:`torch.optim.Optimizer` s on the flat buffers of ``ops/optim.py``
(param groups, LR schedulers, ``state_dict``, ``zero_grad`` as torch's), stepping all
of a group's tensors with a few launches of ``ops/layerwise_kernels.py`` however many
tensors it holds. State is kept under torch's names (``momentum_buffer``; ``step``,
``exp_avg``, ``exp_avg_sq``), so a ``FusedSGD`` / ``SGD`` state dict loads into
``FusedLARS`` (and an ``AdamW`` one into ``FusedLAMB``): a fit can switch to the
layer-wise optimizer when its batch grows.

Every tensor takes its trust ratio by default, as in the LARS paper's algorithm.
``exclude_1d=True`` (per param group) is the MLPerf and SimCLR recipes' exclusion:
parameters with at most one dimension, the biases and the normalisation layers'
scales and shifts, take the plain step (SGD / Adam) with neither ratio nor weight
decay. That suits networks normalised throughout (ResNets); in a network without
normalisation layers a bias's plain step at LARS's global LR (tens of times SGD's)
diverged: on the four held-out datasets of ``benchmarks/bench_layerwise_accuracy.py``
the excluded form lost 2 of them outright where every tensor adapted kept training.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from dataflow.core.errors import ConfigError
from dataflow.ops.flat import CPU_CHUNK, CUDA_CHUNK, chunk_table
from dataflow.ops.layerwise_cuda import lamb_cuda, lars_cuda
from dataflow.ops.layerwise_kernels import lamb_cpu, lamb_reference, lars_cpu, lars_reference
from dataflow.ops.optim import FlatParams, FusedAdam, FusedSGD, _real, runs
from dataflow.ops.registry import (
    Op,
    as_arrays,
    check,
    match_torch_threads,
    register,
    torch_stream,
)

LARS_STEP = register(Op("lars_step", lars_cpu, lars_cuda, lars_reference))
LAMB_STEP = register(Op("lamb_step", lamb_cpu, lamb_cuda, lamb_reference))


class _Layout:
    """The chunk table of one launch (a run of a flat buffer's tensors) and which
    tensors adapt; on CUDA the tables live on the device. Built once per run."""

    def __init__(self, flat: FlatParams, first: int, stop: int, exclude_1d: bool) -> None:
        device = flat.param.device
        base = flat.offsets[first]
        starts = np.asarray(flat.offsets[first:stop], dtype=np.int64) - base
        lengths = [p.numel() for p in flat.params[first:stop]]
        chunk = CPU_CHUNK if device.type == "cpu" else CUDA_CHUNK
        table, bounds = chunk_table(lengths, starts, starts, chunk)
        table = np.ascontiguousarray(table[:, [0, 1, 3]])  # segment, start, length
        adapt = np.array(
            [not (exclude_1d and p.dim() <= 1) for p in flat.params[first:stop]], dtype=np.int8
        )
        self.chunks, self.segments = table.shape[0], stop - first
        self.host = (table, bounds, adapt)
        if device.type == "cpu":
            self.tables = self.host
        else:
            tensors = [torch.from_numpy(a).to(device) for a in self.host]
            self.tables = tuple(as_arrays(tensors, device))
            self._keep = tensors  # the device arrays view these


def _launch(op: Op, layout: _Layout, tensors: list[torch.Tensor], **params: Any) -> None:
    """Run a layer-wise op over ``tensors`` (param, grad, state...: one run's spans),
    all written in place but the gradient."""
    device = check(op, tensors, inplace=[i for i in range(len(tensors)) if i != 1])
    arrays = as_arrays(tensors, device)
    if device.type == "cpu":
        match_torch_threads(tensors[0].numel())
        op.cpu(*arrays, *layout.tables, **params)
        return
    partial = torch.empty((max(layout.chunks, 1), 2), dtype=torch.float64, device=device)
    factor = torch.empty(max(layout.segments, 1), dtype=tensors[0].dtype, device=device)
    scratch = as_arrays([partial, factor], device)
    op.cuda(
        *arrays,
        *layout.tables,
        stream=torch_stream(),
        partial=scratch[0],
        factor=scratch[1],
        **params,
    )


class _Layouts:
    """What FusedLARS and FusedLAMB share: their launch layouts, kept per run."""

    def _layout(self, flat: FlatParams, first: int, stop: int, exclude_1d: bool) -> _Layout:
        layouts = self.__dict__.setdefault("_layouts", {})
        key = (id(flat), first, stop, exclude_1d)
        if key not in layouts:
            layouts[key] = _Layout(flat, first, stop, exclude_1d)
        return layouts[key]


def _flag(name: str, where: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: {key}={value!r} in {where} must be a bool")


class FusedLARS(_Layouts, FusedSGD):
    """LARS: SGD with momentum whose step for each tensor is scaled by its trust ratio.

    For a tensor ``w`` with gradient ``g`` (``exclude_1d``: unless it has at most one
    dimension): ``d = (g + weight_decay * w) * ratio``, ``ratio = trust_coefficient *
    |w| / (|g| + weight_decay * |w| + eps)`` (1 when ``|w|`` or ``|g|`` is 0); then
    torch's SGD on ``d``: ``m = momentum * m + (1 - dampening) * d`` (``d`` on the
    first step), ``w -= lr * m`` (nesterov: ``lr * (d + momentum * m)``). The LR is the
    global one the schedules scale; the ratio adapts it per layer. As timm's ``Lars``
    and apex's ``LARC`` without clipping.
    """

    op = LARS_STEP

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        exclude_1d: bool = False,
    ) -> None:
        self._more_defaults = {
            "trust_coefficient": trust_coefficient,
            "eps": eps,
            "exclude_1d": exclude_1d,
        }
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov)

    def _validate(self, group: dict[str, Any], where: str) -> None:
        name = "FusedLARS"
        if group.get("maximize"):
            raise ConfigError(f"{name}: maximize=True in {where} is not supported")
        super()._validate(group, where)
        _real(name, where, "trust_coefficient", group["trust_coefficient"], low=0)
        if group["trust_coefficient"] == 0:
            raise ConfigError(
                f"{name}: trust_coefficient=0 in {where} makes every adapted step zero; "
                "use a positive value (0.001 is the LARS paper's)"
            )
        _real(name, where, "eps", group["eps"], low=0)
        _flag(name, where, "exclude_1d", group["exclude_1d"])

    def _step(self, group: dict[str, Any], flat: FlatParams, has_grad: list[bool]) -> None:
        momentum = float(group["momentum"])
        buf = flat.buffer("momentum_buffer") if momentum else None
        keys = [
            (("momentum_buffer" in self.state.get(p, ())) if momentum else True) if h else None
            for p, h in zip(flat.params, has_grad, strict=True)
        ]
        for first, stop, initialized in runs(keys):
            span = flat.span(first, stop)
            layout = self._layout(flat, first, stop, bool(group["exclude_1d"]))
            state = buf[span] if buf is not None else flat.grad[span]  # unread without
            _launch(
                self.op,
                layout,
                [flat.param[span], flat.grad[span], state],
                lr=float(group["lr"]),
                momentum=momentum,
                dampening=float(group["dampening"]),
                weight_decay=float(group["weight_decay"]),
                nesterov=bool(group["nesterov"]),
                trust_coefficient=float(group["trust_coefficient"]),
                eps=float(group["eps"]),
                first=not initialized,
            )
            if buf is not None and not initialized:
                views = flat.views(buf)
                for i in range(first, stop):
                    self.state[flat.params[i]]["momentum_buffer"] = views[i]


class FusedLAMB(_Layouts, FusedAdam):
    """LAMB: Adam whose step for each tensor is scaled by its trust ratio.

    For a tensor ``w`` with gradient ``g``: Adam's moments ``m``, ``v`` with bias
    correction, ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``, ``w -= lr *
    ratio * u`` with ``ratio = |w| / |u|`` (1 when either is 0). With ``exclude_1d``, a
    tensor of at most one dimension takes Adam's step ``u = m_hat / (sqrt(v_hat) +
    eps)``, ratio 1 and no decay. As NVIDIA apex's ``FusedLAMB`` (without its global
    gradient clipping: use ``Pipeline(clip_grad_norm=)``).
    """

    op = LAMB_STEP

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        exclude_1d: bool = False,
    ) -> None:
        self._more_defaults = {"exclude_1d": exclude_1d}
        super().__init__(params, lr, betas, eps, weight_decay)

    def _validate(self, group: dict[str, Any], where: str) -> None:
        name = "FusedLAMB"
        if group.get("maximize"):
            raise ConfigError(f"{name}: maximize=True in {where} is not supported")
        super()._validate(group, where)
        _flag(name, where, "exclude_1d", group["exclude_1d"])

    def _step(self, group: dict[str, Any], flat: FlatParams, has_grad: list[bool]) -> None:
        steps = self._steps(flat)
        counts = steps.numpy()
        m, v = flat.buffer("exp_avg"), flat.buffer("exp_avg_sq")
        keys = [int(counts[i]) if h else None for i, h in enumerate(has_grad)]
        beta1, beta2 = (float(b) for b in group["betas"])
        for first, stop, done in runs(keys):
            span = flat.span(first, stop)
            layout = self._layout(flat, first, stop, bool(group["exclude_1d"]))
            _launch(
                self.op,
                layout,
                [flat.param[span], flat.grad[span], m[span], v[span]],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                step=done + 1,
            )
            counts[first:stop] = done + 1
            if done == 0:
                m_views, v_views = flat.views(m), flat.views(v)
                for i in range(first, stop):
                    self.state[flat.params[i]] = {
                        "step": steps[i],
                        "exp_avg": m_views[i],
                        "exp_avg_sq": v_views[i],
                    }
