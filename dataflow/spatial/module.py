"""``partition(module, layout, group)``: an unmodified CNN as its spatially partitioned form.

The model is traced once with ``torch.fx``; each node is classified by what its input
is on each rank (a region of the sample, or the whole sample): convolution and
pooling become :class:`~dataflow.spatial.layers.WindowedLayer` s, BatchNorm reduces
its statistics over the group, pointwise layers stay as they are, and a gather goes
before the first layer that needs the whole sample (Flatten, Linear, a reshape, the
output). Global average pooling becomes a reduction. Anything else on a region is
refused by name. The global shape of every node comes from running the traced graph
on meta tensors, once per input shape.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from dataflow.core.errors import ModelError
from dataflow.spatial.comm import HaloPlan, SpatialGroup, allreduce_sum, scale_grad
from dataflow.spatial.geometry import Exchange, clip, exchange, split_extent
from dataflow.spatial.layers import (
    DimSplit,
    Gather,
    GlobalAvgPool,
    SharedDropout,
    SpatialAvgPool,
    SpatialBatchNorm,
    SpatialConv,
    SpatialMaxPool,
    WindowedLayer,
)

POINTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.PReLU,
    nn.Identity, nn.LogSigmoid, nn.Softsign, nn.Tanhshrink, nn.Threshold,
    nn.LocalResponseNorm,
)  # fmt: skip
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
NEEDS_WHOLE_MODULES = (
    nn.Flatten, nn.Unflatten, nn.Linear, nn.Bilinear, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)  # fmt: skip
POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.relu, torch.sigmoid, torch.tanh,
    torch.exp, torch.log, torch.log1p, torch.abs, torch.clamp, torch.sqrt, torch.square,
    F.relu, F.relu6, F.leaky_relu, F.gelu, F.silu, F.elu, F.selu, F.mish, F.softplus,
    F.hardtanh, F.hardswish, F.sigmoid, F.tanh,
}  # fmt: skip
POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "relu", "sigmoid", "tanh", "exp", "log", "abs", "clamp",
    "contiguous", "float", "double", "half", "neg", "pow", "sqrt", "square",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__",
}  # fmt: skip
NEEDS_WHOLE_FUNCTIONS = {
    torch.flatten, torch.reshape, torch.mean, torch.sum, torch.amax, torch.max,
    F.linear, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
}  # fmt: skip
NEEDS_WHOLE_METHODS = {
    "flatten",
    "view",
    "reshape",
    "mean",
    "sum",
    "amax",
    "max",
    "squeeze",
    "unsqueeze",
    "permute",
    "transpose",
}
WHAT_TO_DO = (
    "use the layers dataflow partitions (nn.Conv*, nn.MaxPool*, nn.AvgPool*, nn.BatchNorm*, "
    "pointwise activations, nn.Dropout), move the layer after the first nn.Flatten / "
    "nn.Linear / global pooling (where the sample is whole again), or train with spatial=1"
)

SPLIT, WHOLE, VALUE = "split", "whole", "value"


class SpatialModule(nn.Module):
    """The partitioned model on one rank of a spatial group.

    Takes this rank's region of each sample (split along ``dims``, tensor dimensions
    counted with batch and channels, by ``weights`` per split dimension) and returns
    the whole output on every rank. Each rank's loss gradient is scaled by 1/P, so
    the parameter gradients summed over the group are the unpartitioned model's.
    """

    def __init__(
        self,
        module: nn.Module,
        group: SpatialGroup,
        dims: Sequence[int],
        weights: Sequence[Sequence[float]] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if len(dims) != len(group.grid):
            raise ModelError(
                f"dims={tuple(dims)} must name one tensor dimension per grid dimension {group.grid}"
            )
        self.group, self.dims = group, tuple(dims)
        self.weights = (
            tuple(tuple(w) for w in weights) if weights else tuple((1.0,) * g for g in group.grid)
        )
        module = copy.deepcopy(module)  # the caller's module stays as it was
        traced = _trace(module)
        object.__setattr__(self, "_meta", copy.deepcopy(traced).to("meta"))  # not a child
        graph, self._layers = _rewrite(traced, group.rank)
        self._generator = torch.Generator().manual_seed(seed)  # the group's dropout masks
        for layer in self._layers.values():
            if isinstance(layer, SharedDropout):
                layer.generator = self._generator
            elif hasattr(layer, "group"):
                layer.group = group
        for name, child in module.named_children():  # the original names, in order
            self.add_module(name, _swapped(child, name, self._layers))
        for name, param in module.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in module.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        for name, layer in self._layers.items():
            if name.startswith("spatial_"):  # inserted gathers: no parameters or buffers
                self.add_module(name, layer)
        gm = torch.fx.GraphModule(self, graph)
        object.__setattr__(self, "_graph_module", gm)
        self._plans: dict[Any, dict[str, Any]] = {}

    @property
    def dropout_generator(self) -> torch.Generator:
        """The generator the group's dropout layers draw their shared masks from: its
        state goes into commits and checkpoints with the process's random state, so a
        rollback or a resume draws the same masks."""
        return self._generator

    def forward(self, x: torch.Tensor) -> Any:
        full = self._global_shape(x)
        plan = self._plans.get((full, x.dtype))
        if plan is None:
            plan = self._plans[(full, x.dtype)] = self._plan(full, x.dtype)
        for name, settings in plan.items():
            for key, value in settings.items():
                setattr(self._layers[name], key, value)
        out = self._graph_module(x)
        scale = 1.0 / self.group.size
        if isinstance(out, torch.Tensor):
            return scale_grad(out, scale)
        return type(out)(scale_grad(o, scale) if isinstance(o, torch.Tensor) else o for o in out)

    def _global_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """All ranks' extents along the split dimensions (one tiny allreduce), checked
        against the split the layout prescribes."""
        # on x's device: an NCCL group reduces only CUDA tensors
        extents = torch.zeros(self.group.size, len(self.dims), dtype=torch.float64, device=x.device)
        extents[self.group.rank] = torch.tensor(
            [float(x.shape[d]) for d in self.dims], dtype=torch.float64
        )
        extents = self.group.allreduce_(extents).cpu()
        shape = list(x.shape)
        for i, d in enumerate(self.dims):
            lines = {}
            for r in range(self.group.size):
                lines.setdefault(_coord(self.group, r, i), int(extents[r, i]))
            shape[d] = sum(lines.values())
            expected = [
                hi - lo for lo, hi in split_extent(shape[d], self.group.grid[i], self.weights[i])
            ]
            if [lines[c] for c in range(self.group.grid[i])] != expected:
                raise ModelError(
                    f"spatial input: the regions along dimension {d} have "
                    f"{[lines[c] for c in sorted(lines)]} rows, but a split of {shape[d]} rows "
                    f"by weights {self.weights[i]} gives {expected}; read each rank's region "
                    "with dataflow.Layout.region(sample_shape, rank)"
                )
        return tuple(shape)

    def _plan(self, full: tuple[int, ...], dtype: torch.dtype) -> dict[str, dict[str, Any]]:
        meta = torch.empty(full, device="meta", dtype=dtype)
        ShapeProp(self._meta).propagate(meta)
        shapes = {
            n.name: tuple(n.meta["tensor_meta"].shape)
            for n in self._meta.graph.nodes
            if _has_shape(n)
        }
        plan: dict[str, dict[str, Any]] = {}
        for tag, (name, layer) in enumerate(self._layers.items()):
            source = layer._spatial_input
            in_shape = shapes[source]
            if isinstance(layer, WindowedLayer):
                out_shape = shapes[layer._spatial_node]
                plan[name] = {
                    "splits": self._dim_splits(layer, in_shape, out_shape, tag),
                    "_full_out": tuple(out_shape[2:]),
                }
            elif isinstance(layer, (Gather, SharedDropout)) and layer._spatial_split:
                plan[name] = {"box": self._box(in_shape), "full": tuple(in_shape[1:])}
            elif isinstance(layer, GlobalAvgPool):
                count = 1
                for extent in in_shape[2:]:
                    count *= extent
                plan[name] = {"count": count}
        return plan

    def _box(self, shape: Sequence[int]) -> tuple[tuple[int, tuple[int, int]], ...]:
        return tuple(
            (d, split_extent(shape[d], self.group.grid[i], self.weights[i])[self.group.coords[i]])
            for i, d in enumerate(self.dims)
        )

    def _dim_splits(
        self, layer: WindowedLayer, in_shape, out_shape, tag: int
    ) -> tuple[DimSplit, ...]:  # type: ignore[no-untyped-def]
        windows = layer.windows()
        splits = []
        for i, d in enumerate(self.dims):
            window, parts, me = windows[d - 2], self.group.grid[i], self.group.coords[i]
            n_in, n_out = in_shape[d], out_shape[d]
            owned = split_extent(n_in, parts, self.weights[i])
            outs = split_extent(n_out, parts, self.weights[i])
            needs = [clip(window.needed(o), n_in) for o in outs]
            traffic: Exchange = exchange(me, owned, needs)
            halo = None
            if not all(exchange(q, owned, needs).empty for q in range(parts)):
                halo = HaloPlan(
                    self.group,
                    d,
                    i,
                    owned[me],
                    needs[me],
                    traffic,
                    tag=(tag * 8 + i * 2) % (1 << 30),
                )
            splits.append(
                DimSplit(d, window, n_in, owned[me], outs[me], window.inside(owned[me]), halo)
            )
        return tuple(splits)


def _coord(group: SpatialGroup, rank: int, i: int) -> int:
    from dataflow.spatial.geometry import coords_of

    return coords_of(rank, group.grid)[i]


def _has_shape(node: torch.fx.Node) -> bool:
    meta = node.meta.get("tensor_meta")
    return meta is not None and hasattr(meta, "shape")


def _trace(module: nn.Module) -> torch.fx.GraphModule:
    try:
        return torch.fx.symbolic_trace(module)
    except Exception as exc:
        raise ModelError(
            f"spatial partition: could not trace {type(module).__name__} with torch.fx ({exc}). "
            "A partitioned model's forward must not branch on tensor values; move such logic "
            "out of forward() or train with spatial=1"
        ) from exc


def _swapped(child: nn.Module, prefix: str, layers: dict[str, nn.Module]) -> nn.Module:
    """``child`` with its partitioned descendants swapped in (same names, same order)."""
    if prefix in layers:
        return layers[prefix]
    for name, grandchild in list(child.named_children()):
        setattr(child, name, _swapped(grandchild, f"{prefix}.{name}", layers))
    return child


def _rewrite(
    traced: torch.fx.GraphModule, rank: int
) -> tuple[torch.fx.Graph, dict[str, nn.Module]]:
    """Classify every node, swap in partitioned layers and insert gathers."""
    graph = traced.graph
    modules = dict(traced.named_modules())
    state: dict[torch.fx.Node, str] = {}
    layers: dict[str, nn.Module] = {}
    gathers: dict[torch.fx.Node, torch.fx.Node] = {}

    def whole(node: Any, user: torch.fx.Node) -> Any:
        if not isinstance(node, torch.fx.Node) or state.get(node) != SPLIT:
            return node
        if node not in gathers:
            name = f"spatial_gather_{len(gathers)}"
            layer = Gather()
            layer._spatial_input, layer._spatial_split = node.name, True
            layers[name] = layer
            with graph.inserting_after(node):
                gathers[node] = graph.create_node("call_module", name, (node,))
            state[gathers[node]] = WHOLE
        return gathers[node]

    def regather(user: torch.fx.Node) -> None:
        user.args = torch.fx.map_arg(user.args, lambda n: whole(n, user))
        user.kwargs = torch.fx.map_arg(user.kwargs, lambda n: whole(n, user))

    for node in list(graph.nodes):
        if node.op == "placeholder":
            state[node] = SPLIT if not state else VALUE  # the first input is the sample
            continue
        if node.op == "get_attr":
            state[node] = WHOLE
            continue
        split_in = [n for n in node.all_input_nodes if state.get(n) == SPLIT]
        if node.op == "output":
            regather(node)
            continue
        if not split_in:
            state[node] = WHOLE if node.op != "call_method" or node.target != "size" else VALUE
            if node.op == "call_module" and isinstance(modules[node.target], DROPOUT):
                layers[node.target] = _dropout(modules[node.target], node, split=False)
            continue
        state[node] = _classify(node, modules, layers, regather, whole)
    graph.owning_module = None  # linted by GraphModule, once the gathers are modules
    return graph, layers


def _dropout(module: nn.Module, node: torch.fx.Node, *, split: bool) -> SharedDropout:
    layer = SharedDropout(module)
    layer._spatial_input, layer._spatial_split = node.args[0].name, split
    return layer


def _classify(node, modules, layers, regather, whole) -> str:  # type: ignore[no-untyped-def]
    """What ``node`` yields when an input of it is a region; swaps or gathers as needed."""
    if node.op == "call_module":
        module = modules[node.target]
        swap = _partitioned(module)
        if swap is not None:
            swap._spatial_input, swap._spatial_node = node.args[0].name, node.name
            layers[node.target] = swap
            return SPLIT
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            layers[node.target] = SpatialBatchNorm(module)
            layers[node.target]._spatial_input = node.args[0].name
            return SPLIT
        if isinstance(module, DROPOUT):
            layers[node.target] = _dropout(module, node, split=True)
            return SPLIT
        if isinstance(module, POINTWISE_MODULES):
            return SPLIT
        if isinstance(
            module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
        ) and all(s == 1 for s in _pairs(module.output_size)):
            layer = GlobalAvgPool(_spatial_dims_of(module))
            layer._spatial_input = node.args[0].name
            layers[node.target] = layer
            return WHOLE
        if isinstance(module, NEEDS_WHOLE_MODULES):
            regather(node)
            return WHOLE
        raise ModelError(
            f"spatial partition: layer {node.target!r} ({type(module).__name__}) cannot run on "
            f"a region of the sample; {WHAT_TO_DO}"
        )
    target = node.target
    if node.op == "call_method" and target == "size":
        if len(node.args) > 1 and node.args[1] in (0, 1):
            return VALUE
        regather(node)
        return VALUE
    if (node.op == "call_function" and target in POINTWISE_FUNCTIONS) or (
        node.op == "call_method" and target in POINTWISE_METHODS
    ):
        return SPLIT
    if node.op == "call_function" and target is torch.cat and _cat_dim(node) == 1:
        return SPLIT
    if (node.op == "call_function" and target in NEEDS_WHOLE_FUNCTIONS) or (
        node.op == "call_method" and target in NEEDS_WHOLE_METHODS
    ):
        regather(node)
        return WHOLE
    what = getattr(target, "__name__", str(target))
    raise ModelError(
        f"spatial partition: {node.op} {what!r} (node {node.name!r}) cannot run on a region "
        f"of the sample; {WHAT_TO_DO}"
    )


def _pairs(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _spatial_dims_of(module: nn.Module) -> int:
    return int(type(module).__name__[-2])


def _cat_dim(node: torch.fx.Node) -> int:
    return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)


def _partitioned(module: nn.Module) -> WindowedLayer | None:
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        if module.padding_mode != "zeros":
            raise ModelError(
                f"spatial partition: {type(module).__name__} with padding_mode="
                f"{module.padding_mode!r} cannot be partitioned (only 'zeros'); use zero padding"
            )
        return SpatialConv(module)
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        if module.return_indices:
            raise ModelError(
                "spatial partition: MaxPool with return_indices=True cannot be partitioned"
            )
        return SpatialMaxPool(module, _spatial_dims_of(module))
    if isinstance(module, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return SpatialAvgPool(module, _spatial_dims_of(module))
    return None


__all__ = ["SpatialModule", "allreduce_sum"]
