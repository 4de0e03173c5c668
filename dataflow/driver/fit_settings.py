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
from dataflow.planning.layout import whole_replicas

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


@dataclass(frozen=True)
class WorkerScaling:
    """``scale_with_batch``'s settings: what the fit machine needs to decide, before each
    later phase, how many workers to ask the cluster for (:func:`more_workers`)."""

    max_workers: int
    max_micro_batch: int
    cost_model: CostModel | None = None  # the user's (None: fill the memory cap)
    wire_scale: float = 1.0  # bytes on the wire per fp32 gradient byte (0.5: bf16)
    timeout_s: float = 120.0  # how long to wait for the workers asked for
    spatial: int = 1  # workers per replica: asked for in whole replicas

    @classmethod
    def of(cls, config: Any, wire_scale: float = 1.0) -> WorkerScaling:
        """From a ``TrainerConfig`` with ``scale_with_batch`` (it checked the cap and the
        maximum are there)."""
        return cls(
            max_workers=config.max_workers,
            max_micro_batch=config.max_micro_batch,
            cost_model=config.cost_model,
            wire_scale=wire_scale,
            timeout_s=config.scale_timeout_s,
            spatial=config.spatial,
        )


@dataclass(frozen=True)
class WorkersWanted:
    """How many workers a phase's batch wants, who chose the count, and what the cost
    model predicted (the row ``history.info["scaling"]`` records)."""

    requested: int
    chosen_by: str  # "max_micro_batch" or "cost model"
    predicted_samples_per_second: float | None = None  # at ``requested`` (cost model)
    predicted_at_max: float | None = None  # at ``max_workers`` (cost model)

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"requested": self.requested, "chosen_by": self.chosen_by}
        if self.predicted_samples_per_second is not None:
            row["predicted_samples_per_second"] = self.predicted_samples_per_second
            row["predicted_at_max"] = self.predicted_at_max
        return row


def _model(config: Any, wire_scale: float = 1.0) -> CostModel | None:
    """The user's cost model with the fit's memory cap, and the bytes its allreduce
    really moves (``wire_scale``: half of fp32's over a bf16 wire)."""
    cap = config.max_micro_batch if isinstance(config.max_micro_batch, int) else None
    return _fit_model(config.cost_model, cap, wire_scale)


def _fit_model(model: CostModel | None, cap: int | None, wire_scale: float) -> CostModel | None:
    if model is None:
        return None
    if model.max_micro_batch is None and cap is not None:
        model = model.replace(max_micro_batch=cap)
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


def workers_wanted(scaling: WorkerScaling, global_batch: int) -> WorkersWanted:
    """``scale_with_batch``: how many workers to ask the cluster for at ``global_batch``.

    With a cost model: the count with the best goodput up to ``max_workers`` (at a
    fixed batch the statistical efficiency is the same for every count, so the count
    with the best predicted throughput, the fewest within 2 %); without one: enough
    that no replica's batch exceeds ``max_micro_batch``. Counted in replicas, asked
    for in workers (``spatial`` per replica), never more than ``max_workers``."""
    size, cap = scaling.spatial, scaling.max_micro_batch
    most = whole_replicas(scaling.max_workers, size)
    model = _fit_model(scaling.cost_model, cap, scaling.wire_scale)
    if model is None:
        replicas = min(most, math.ceil(global_batch / cap))
        return WorkersWanted(replicas * size, "max_micro_batch")
    wanted, table = best_replicas(model, global_batch=global_batch, max_replicas=most)
    return WorkersWanted(wanted * size, "cost model", dict(table)[wanted], table[-1][1])


def more_workers(scaling: WorkerScaling, global_batch: int, have: int) -> WorkersWanted | None:
    """The workers to ask the cluster for before a phase of ``global_batch``, when the
    fit has ``have`` (its members' and its pool's); None when that is enough."""
    wanted = workers_wanted(scaling, global_batch)
    return wanted if wanted.requested > have else None
