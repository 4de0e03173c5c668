"""The cost model: predict a fit's step time, throughput, scaling efficiency and memory
term by term, and plan from it (worker count by goodput, window and bucket sizes, the
layout: :mod:`dataflow.costmodel.layout_cost`).

Prediction is pure (no torch, no Dask). :func:`calibrate` measures the terms on a real
cluster; :mod:`dataflow.costmodel.presets` builds models from published hardware
constants. See docs/costmodel.md.
"""

from __future__ import annotations

from typing import Any

from dataflow.costmodel import presets
from dataflow.costmodel.best_settings import (
    best_batch,
    best_replicas,
    bucket_bytes,
    goodput,
    statistical_efficiency,
    window_seconds,
    window_steps,
)
from dataflow.costmodel.collective import (
    ALGORITHMS,
    Link,
    Topology,
    allreduce_seconds,
    bucket_sizes,
    exposed_allreduce_seconds,
    ring_seconds,
    tree_seconds,
    two_level_seconds,
)
from dataflow.costmodel.compute import ComputeFit, MemoryModel, fit_line
from dataflow.costmodel.layout_cost import (
    LayerFit,
    LayerShape,
    LayoutCandidate,
    LayoutModel,
    LayoutPrediction,
)
from dataflow.costmodel.layout_cost import candidates as layout_candidates
from dataflow.costmodel.model import CostModel, StepBreakdown


def calibrate(pipe: Any, client: Any, **kwargs: Any) -> CostModel:
    """Measure the cost model's terms for ``pipe`` on ``client``'s workers (see
    :func:`dataflow.costmodel.calibration.calibrate`)."""
    from dataflow.costmodel.calibration import calibrate as _calibrate

    return _calibrate(pipe, client, **kwargs)


def measure_allreduce(client: Any, workers: Any, sizes: Any, **kwargs: Any) -> Any:
    """The median seconds of one allreduce of each of ``sizes`` bytes over ``workers``
    (see :func:`dataflow.costmodel.link_calibration.measure_allreduce`)."""
    from dataflow.costmodel.link_calibration import measure_allreduce as _measure

    return _measure(client, workers, sizes, **kwargs)


__all__ = [
    "ALGORITHMS",
    "ComputeFit",
    "CostModel",
    "LayerFit",
    "LayerShape",
    "LayoutCandidate",
    "LayoutModel",
    "LayoutPrediction",
    "Link",
    "MemoryModel",
    "StepBreakdown",
    "Topology",
    "allreduce_seconds",
    "best_batch",
    "best_replicas",
    "bucket_bytes",
    "bucket_sizes",
    "calibrate",
    "exposed_allreduce_seconds",
    "fit_line",
    "goodput",
    "layout_candidates",
    "measure_allreduce",
    "presets",
    "ring_seconds",
    "statistical_efficiency",
    "tree_seconds",
    "two_level_seconds",
    "window_seconds",
    "window_steps",
]
