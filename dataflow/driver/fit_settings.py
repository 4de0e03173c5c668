"""A fit's settings and who chose each, pure: the window length, the allreduce bucket
size and, with ``scale_with_batch``, the worker count. A value the user gave wins, then
the cost model's best (:mod:`dataflow.costmodel.best_settings`); with
no cost model the engine's defaults stand (1 s windows, 25 MiB buckets, and as many
workers as keep each replica's batch under ``max_micro_batch``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dataflow.costmodel import CostModel, best_replicas, bucket_bytes, window_seconds
from dataflow.costmodel.model import MIB

DEFAULT_WINDOW_SECONDS = 1.0
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class FitPlan:
    """The fit-wide choices and where each came from ("user", "cost model", "default")."""

    window_seconds: float
    bucket_mb: float  # of fp32 gradients, as the reducer packs them
    chosen_by: dict[str, str] = field(default_factory=dict)
    # bytes on the wire per fp32 gradient byte: 0.5 with allreduce_dtype="bf16"
    wire_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_seconds": self.window_seconds,
            "bucket_mb": self.bucket_mb,
            "chosen_by": dict(self.chosen_by),
            "wire_scale": self.wire_scale,
        }


def _model(config: Any, wire_scale: float = 1.0) -> CostModel | None:
    """The user's cost model with the fit's memory cap, and the bytes its allreduce
    really moves (``wire_scale``: half of fp32's over a bf16 wire)."""
    model = config.cost_model
    if model is None:
        return None
    if model.max_micro_batch is None and isinstance(config.max_micro_batch, int):
        model = model.replace(max_micro_batch=config.max_micro_batch)
    if wire_scale != 1.0:
        model = model.replace(gradient_bytes=int(model.gradient_bytes * wire_scale))
    return model


def plan_fit(
    config: Any,
    *,
    user_bucket_mb: float | None,
    replicas: int,
    global_batch: int,
    wire_scale: float = 1.0,
) -> FitPlan:
    """The window length and bucket size for a fit that starts on ``replicas`` at
    ``global_batch`` (the bucket is chosen once: changing it means new buckets).
    ``wire_scale``: bytes on the wire per fp32 gradient byte (0.5: a bf16 allreduce)."""
    model = _model(config, wire_scale)
    chosen: dict[str, str] = {}
    if config.window_seconds is not None:
        seconds, chosen["window_seconds"] = float(config.window_seconds), "user"
    elif model is not None:
        seconds, chosen["window_seconds"] = window_seconds(model), "cost model"
    else:
        seconds, chosen["window_seconds"] = DEFAULT_WINDOW_SECONDS, "default"
    if user_bucket_mb is not None:
        bucket, chosen["bucket_mb"] = float(user_bucket_mb), "user"
    elif model is not None and replicas > 1:
        size, _ = bucket_bytes(model, replicas=replicas, global_batch=global_batch)
        bucket, chosen["bucket_mb"] = size / wire_scale / MIB, "cost model"  # fp32 bytes
    else:
        bucket, chosen["bucket_mb"] = DEFAULT_BUCKET_MB, "default"
    return FitPlan(
        window_seconds=seconds, bucket_mb=bucket, chosen_by=chosen, wire_scale=wire_scale
    )


def planned_model(config: Any, fit_plan: FitPlan) -> CostModel | None:
    """The fit's cost model as the fit runs: its window length, bucket size, fixed
    ``window_steps`` and memory cap (what each phase's prediction uses)."""
    model = _model(config, fit_plan.wire_scale)
    if model is None:
        return None
    return model.replace(
        window_seconds=fit_plan.window_seconds,
        window_steps=config.window_steps,
        bucket_bytes=max(1, int(fit_plan.bucket_mb * fit_plan.wire_scale * MIB)),
    )


def workers_wanted(config: Any, global_batch: int, wire_scale: float = 1.0) -> dict[str, Any]:
    """``scale_with_batch``: how many workers to ask the cluster for at ``global_batch``.

    With a cost model: the count with the best goodput up to ``max_workers`` (at a
    fixed batch the statistical efficiency is the same for every count, so the count
    with the best predicted throughput, the fewest within 2 %); without one: enough
    that no replica's batch exceeds ``max_micro_batch``."""
    model = _model(config, wire_scale)
    if model is None:
        wanted = min(config.max_workers, math.ceil(global_batch / config.max_micro_batch))
        return {"requested": wanted, "chosen_by": "max_micro_batch"}
    wanted, table = best_replicas(model, global_batch=global_batch, max_replicas=config.max_workers)
    return {
        "requested": wanted,
        "chosen_by": "cost model",
        "predicted_samples_per_second": dict(table)[wanted],
        "predicted_at_max": table[-1][1],
    }
