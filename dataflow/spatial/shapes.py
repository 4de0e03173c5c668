"""A model's layers as the layout model sees them
(:class:`~dataflow.costmodel.layout_cost.LayerShape`): traced with ``torch.fx``,
shapes from meta tensors, each node classified as
``SpatialModule`` classifies it, with a "gather" where it would insert one."""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from dataflow.core.errors import ModelError
from dataflow.costmodel.layout_ranks import WHOLE_AFTER, LayerShape
from dataflow.spatial.geometry import Window
from dataflow.spatial.module import (
    NEEDS_WHOLE_FUNCTIONS,
    NEEDS_WHOLE_METHODS,
    NEEDS_WHOLE_MODULES,
    POINTWISE_FUNCTIONS,
    POINTWISE_METHODS,
)

VIEWS = {torch.flatten, torch.reshape, "flatten", "view", "reshape", "squeeze", "unsqueeze"}
VIEWS |= {"permute", "transpose", "contiguous"}  # alias their input when they can
FREE = {operator.add, operator.sub, operator.neg, torch.add, torch.sub, "add", "sub", "neg"}
FREE |= {"__add__", "__sub__", "__radd__", torch.sum, torch.mean, "sum", "mean"}
ADAPTIVE_AVG = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)


def layer_shapes(module: nn.Module, sample_shape: Sequence[int]) -> list[LayerShape]:
    """``module``'s layers in execution order for one sample of ``sample_shape``
    (``(channels, *spatial)``), a "gather" where ``SpatialModule`` would insert one."""
    traced = _trace(module)
    modules = dict(traced.named_modules())
    ShapeProp(traced).propagate(torch.empty(1, *sample_shape, device="meta"))
    shapes: list[LayerShape] = []
    split: dict[torch.fx.Node, bool] = {}
    gathered: set[torch.fx.Node] = set()
    used: set[str] = set()
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            split[node] = not split  # the first input is the sample
            continue
        inputs = [n for n in node.all_input_nodes if _shape(n) is not None]
        if node.op == "output" or _shape(node) is None:
            for n in inputs if node.op == "output" else ():
                _gather(n, split, gathered, shapes)
            continue
        kind, variant, windows, params, whole = _classify(node, modules)
        on_region = any(split.get(n, False) for n in inputs)
        if on_region and whole:
            for n in inputs:
                _gather(n, split, gathered, shapes)
            on_region = False
        split[node] = on_region and kind not in WHOLE_AFTER
        name = node.target if node.op == "call_module" and node.target not in used else node.name
        used.add(name)
        source = _shape(inputs[0]) if inputs else _shape(node)
        shapes.append(
            LayerShape(
                name=name,
                kind=kind,
                in_shape=source,
                out_shape=_shape(node),
                windows=windows,
                params=params,
                variant=variant,
            )
        )
    return shapes


def _trace(module: nn.Module) -> torch.fx.GraphModule:
    try:
        return torch.fx.symbolic_trace(copy.deepcopy(module)).to("meta")
    except Exception as exc:
        raise ModelError(
            f"layer_shapes: could not trace {type(module).__name__} with torch.fx ({exc}); "
            "a partitioned model's forward must not branch on tensor values"
        ) from exc


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    if meta is None or not hasattr(meta, "shape"):
        return None
    return tuple(int(n) for n in meta.shape[1:])


def _gather(node: torch.fx.Node, split: dict, gathered: set, shapes: list[LayerShape]) -> None:  # type: ignore[type-arg]
    if split.get(node) and node not in gathered:
        shape = _shape(node)
        name = f"spatial_gather_{len(gathered)}"
        shapes.append(LayerShape(name=name, kind="gather", in_shape=shape, out_shape=shape))
        gathered.add(node)


def _classify(node: torch.fx.Node, modules: dict[str, nn.Module]):  # type: ignore[no-untyped-def]
    """(kind, variant, windows, parameter count, needs the whole sample) of one node,
    as ``SpatialModule`` classifies it."""
    if node.op == "call_module":
        m = modules[node.target]
        params = sum(p.numel() for p in m.parameters())
        if isinstance(m, nn.modules.conv._ConvNd) and not m.transposed:
            return "conv", "", _conv_windows(m), params, False
        if isinstance(m, nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd):
            variant = "max" if isinstance(m, nn.modules.pooling._MaxPoolNd) else "avg"
            return "pool", variant, _pool_windows(m), params, False
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return "norm", "", (), params, False
        if isinstance(m, ADAPTIVE_AVG) and all(s == 1 for s in _tuple(m.output_size, 1)):
            return "reduce", "", (), params, False
        if isinstance(m, nn.Flatten | nn.Unflatten):
            return "pointwise", "view", (), params, True
        if isinstance(m, nn.Identity):
            return "pointwise", "free", (), params, False
        if isinstance(m, NEEDS_WHOLE_MODULES):
            return "dense", "", (), params, True
        return "pointwise", "", (), params, False  # activations, dropout: one copy
    target = node.target
    whole = target in NEEDS_WHOLE_FUNCTIONS or target in NEEDS_WHOLE_METHODS
    if target in VIEWS:
        return "pointwise", "view", (), 0, whole
    if target in FREE:
        return ("dense" if whole else "pointwise"), "free", (), 0, whole
    if target in POINTWISE_FUNCTIONS or target in POINTWISE_METHODS:
        return "pointwise", "", (), 0, False
    return "dense", "", (), 0, True


def _tuple(value: Any, n: int) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, tuple | list) else (value,) * n


def _conv_windows(conv: nn.modules.conv._ConvNd) -> tuple[Window, ...]:
    """As ``SpatialConv.windows`` (string paddings included)."""
    out = []
    for i, (k, s, d) in enumerate(zip(conv.kernel_size, conv.stride, conv.dilation, strict=True)):
        if conv.padding == "valid":
            lo = hi = 0
        elif conv.padding == "same":
            lo, hi = d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2
        else:
            lo = hi = conv.padding[i]
        out.append(Window(k, s, d, lo, hi))
    return tuple(out)


def _pool_windows(pool: nn.Module) -> tuple[Window, ...]:
    nd = int(type(pool).__name__[-2])
    k = _tuple(pool.kernel_size, nd)
    s = _tuple(pool.stride or pool.kernel_size, nd)
    p = _tuple(pool.padding, nd)
    d = _tuple(getattr(pool, "dilation", 1), nd)
    return tuple(Window(*w, w[3], pool.ceil_mode) for w in zip(k, s, d, p, strict=True))


__all__ = ["layer_shapes"]
