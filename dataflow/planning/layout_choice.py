"""Which layout a fit runs: the user's, or the layout model's choice (``layout="auto"``),
checked against ``memory_per_worker``.

The decision itself is the layout model's (``costmodel.layout``, pure); this module
gathers its inputs from the pipeline (the model, one sample's shape, the first phase's
global batch, the link) and turns the chosen candidate into a :class:`Layout`.
"""

from __future__ import annotations

import re
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.planning.layout import Layout

# Between processes of one machine (gloo over loopback TCP), when no calibrated cost
# model says otherwise: about what tests/bench_costmodel measured on this repository's
# CI machine (tens of microseconds per message, about a GB/s).
LOOPBACK = dict(latency_s=50e-6, bandwidth=1.0e9, name="loopback", source="assumed")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: Any, field: str = "memory_per_worker") -> int | None:
    """``value`` in bytes: an int, or a string like ``"512MB"`` or ``"2 GiB"``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r}: give bytes (an int) or a size like '2GiB'")
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if match and match.group(2).lower() in _UNITS:
        number = float(match.group(1))
        if number > 0:
            return int(number * _UNITS[match.group(2).lower()])
    raise ConfigError(
        f"{field}={value!r}: give bytes (an int) or a size like '512MB' or '2GiB' "
        "(units B, KB, MB, GB, KiB, MiB, GiB)"
    )


# Layer timings measured in this process, one per model architecture, sample shape,
# optimizer and torch threads: every later choice for the same inputs reuses them, so
# the same call predicts the same (a fresh timing each call moved the prediction by
# orders of magnitude on a busy machine). ``forget_layout_measurements()`` clears it.
_MEASURED: dict[str, Any] = {}


def layout_model(trainer: Any, *, calibrate: bool) -> Any:
    """The pipeline's :class:`~dataflow.costmodel.layout_cost.LayoutModel`: its layers from a
    trace at one sample's shape, and (``calibrate``) each layer's compute timed here, on
    the driver, once per model architecture and sample shape in this process (later
    calls reuse that measurement, named in every prediction's ``basis``); without,
    memory only (every layer's compute counted as 0)."""
    from dataflow.costmodel.collective import Link, Topology
    from dataflow.costmodel.layout_cost import LayoutModel
    from dataflow.costmodel.layout_ranks import LayerFit
    from dataflow.spatial.profile import calibrate_layout, layer_shapes

    module = trainer.model_factory()
    shape = tuple(trainer.source.sample_shape)
    cost = trainer.config.cost_model
    topology = cost.topology if cost is not None else Topology(intra=Link(**LOOPBACK))
    states = _optimizer_states(trainer, module)
    layers = tuple(layer_shapes(module, shape))
    if calibrate:
        key = _measurement_key(module, shape, states, layers)
        if key not in _MEASURED:
            _MEASURED[key] = calibrate_layout(module, shape, link=topology, optimizer_states=states)
        model = _MEASURED[key]
        link = topology.intra
        notes = {**model.notes, "topology": f"given: {link.name or 'link'} {link.source}".strip()}
        model = model.replace(topology=topology, notes=notes)
        if cost is not None:  # what the engine measured a synchronous step to cost
            model = model.replace(sync_overhead_s=cost.sync_overhead_s, shared=cost.compute.shared)
        return model
    zero = LayerFit(fixed_s=0.0, per_voxel_s=0.0)
    fits = {x.name: zero for x in layers if x.kind != "gather"}
    return LayoutModel(
        layers=layers,
        fits=fits,
        topology=topology,
        optimizer_states=states,
        basis=MEMORY_ONLY,
    )


MEMORY_ONLY = "memory only: the layout is given, compute not measured (counted as 0)"


def forget_layout_measurements() -> None:
    """Drop the layer timings this process measured: the next ``layout="auto"`` choice
    measures again (and names the new measurement in its ``basis``)."""
    _MEASURED.clear()


def _measurement_key(module: Any, shape: tuple, states: int, layers: tuple) -> str:
    import torch

    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    return repr((kind, shape, states, torch.get_num_threads(), layers))


def _optimizer_states(trainer: Any, module: Any) -> int:
    """Weight-sized tensors the optimizer keeps: 2 for Adam's moments, else 1."""
    from dataflow.stages.update import Update

    for stage in trainer.graph:
        if isinstance(stage, Update):
            name = type(stage.config.optimizer(module.parameters())).__name__.lower()
            return 2 if "adam" in name else 1
    return 1


def resolve(trainer: Any, workers: int, epochs: int) -> tuple[Layout | None, list[Any]]:
    """The layout to run on ``workers`` and the candidates weighed (empty when the user
    fixed the layout and gave no memory budget)."""
    config = trainer.config
    budget = parse_bytes(config.memory_per_worker)
    auto = config.layout == "auto"
    if not auto and budget is None:
        return config.layout, []
    model = layout_model(trainer, calibrate=auto)
    batch = trainer.planner().next_phase(0, epochs, None).global_batch
    if auto:
        candidates = model.candidates(workers, global_batch=batch)
    else:
        fixed = config.layout or Layout()
        groups = max(1, workers // fixed.spatial)
        candidates = [_candidate(fixed, groups)]
    ranked = model.choose(candidates, global_batch=batch, budget_bytes=budget)
    if not auto:
        return config.layout, ranked
    best = ranked[0].candidate
    if best.spatial == 1:
        return None, ranked
    dims = tuple(best.dims)
    return Layout(spatial=best.spatial, dims=dims, grid=tuple(best.grid)), ranked


def _candidate(layout: Layout, groups: int) -> Any:
    from dataflow.costmodel.layout_candidates import LayoutCandidate

    if layout.spatial == 1:
        return LayoutCandidate(groups=groups)
    return LayoutCandidate(
        groups=groups, spatial=layout.spatial, dims=layout.dims, grid=layout.grid
    )


def check_transforms(graph: Any, layout: Layout | None) -> None:
    """A random flip or rotation along a split dimension would need another worker's
    region (the mirror image): refused, naming the transform. Transforms that act per
    voxel or per channel are fine; random draws agree within a group (they are seeded
    by the replica)."""
    if layout is None or layout.spatial == 1:
        return
    from dataflow.stages.transform import Transform

    split = set(layout.tensor_dims)
    for stage in graph:
        fn = getattr(getattr(stage, "config", None), "fn", None)
        axes = getattr(fn, "axes", None)
        if isinstance(stage, Transform) and axes is not None and split.intersection(axes):
            raise ConfigError(
                f"transform {type(fn).__name__}(axes={tuple(axes)}) moves data along batch "
                f"axis {sorted(split.intersection(axes))}, which {layout.describe()} splits "
                "over workers; drop that axis from the transform, or split other dimensions "
                "(Layout(dims=...))"
            )
