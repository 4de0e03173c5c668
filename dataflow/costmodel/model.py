"""The cost model: the performance model of docs/costmodel.md ("The formula") made
executable.

Per step: ``t = max(t_load, t_compute(b)) + t_allreduce_exposed + t_batchnorm + t_overhead``
(``t_batchnorm``: ``sync_batchnorm``'s reductions, 0 without it), where
``b`` is the largest replica's local batch, the allreduce runs bucket by bucket behind
backward (:func:`~dataflow.costmodel.collective.exposed_allreduce_seconds`) and the
engine's per-window cost is shared by the steps a window fuses. Every prediction comes
with its breakdown (:class:`StepBreakdown`), so a wrong figure points at its term.
Pure: no torch, no Dask; build it from a calibration (:func:`dataflow.costmodel.calibrate`)
or from a preset (:mod:`dataflow.costmodel.presets`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.costmodel.collective import (
    Link,
    Topology,
    allreduce_seconds,
    bucket_sizes,
    exposed_allreduce_seconds,
)
from dataflow.costmodel.compute import ComputeFit, MemoryModel

MIB = 1 << 20
FIRST_BUCKET_BYTES = MIB  # as stages/buckets.py and DDP


@dataclass(frozen=True)
class StepBreakdown:
    """One predicted step and its terms (seconds). ``step_s`` is
    ``compute_s + data_wait_s + allreduce_exposed_s + batchnorm_s + sync_s + overhead_s``."""

    replicas: int
    global_batch: int
    local_batch: int
    micro_batches: int
    compute_s: float
    data_wait_s: float  # load not hidden behind compute
    allreduce_s: float  # all buckets' allreduces, hidden or not
    allreduce_exposed_s: float  # the part that runs past the end of backward
    overhead_s: float  # the engine's per-window cost, per step
    steps_per_window: int
    sync_s: float = 0.0  # a synchronous step's own cost with several replicas (measured)
    batchnorm_s: float = 0.0  # sync_batchnorm: its layers' reductions, on the compute path

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.data_wait_s
            + self.allreduce_exposed_s
            + self.batchnorm_s
            + self.sync_s
            + self.overhead_s
        )

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(step_s=self.step_s, samples_per_second=self.samples_per_second)
        return out


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """What one fit costs, term by term (see the module docstring).

    ``gradient_bytes``: bytes allreduced per step (the trainable parameters);
    ``load_samples_per_s``: one replica's read + transform rate (None: never limits);
    ``window_overhead_s``: the engine's cost per window (a Dask task round trip and the
    window's bookkeeping); ``phase_overhead_s``: per phase (re-plan, regroup, hand-over);
    ``sync_overhead_s``: per step with more than one replica, what a synchronous step
    costs beyond its compute and the α-β allreduce (waiting for the slowest replica, the
    gradient hooks' copies into the buckets, the collective's wait loop; 0 unless
    calibrated: :func:`dataflow.costmodel.calibrate` measures it from real steps).
    ``discarded``: the timing samples a calibration found implausible and left out (or
    adjusted), each a dict with its ``term``, ``batch``, ``seconds``, ``action`` and
    ``reason`` (:func:`dataflow.costmodel.screening.screen`). ``batchnorm_channels``: with
    ``sync_batchnorm=True``, the channels of each BatchNorm layer, whose statistics are
    reduced over the replicas on the compute path: per layer and micro-batch one
    allreduce of ``2C`` float64 sums forward and one of ``2C`` floats backward (``()``:
    none).
    """

    compute: ComputeFit
    gradient_bytes: int
    topology: Topology
    bucket_bytes: int = 25 * MIB
    overlap: float = 1.0
    load_samples_per_s: float | None = None
    window_overhead_s: float = 0.0
    phase_overhead_s: float = 0.0
    sync_overhead_s: float = 0.0
    window_seconds: float = 1.0
    window_steps: int | None = None
    max_micro_batch: int | None = None
    memory: MemoryModel | None = None
    name: str = ""
    notes: dict[str, str] = field(default_factory=dict)  # where each term came from
    discarded: tuple[dict[str, Any], ...] = ()
    batchnorm_channels: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "discarded", tuple(dict(d) for d in self.discarded))
        object.__setattr__(self, "batchnorm_channels", tuple(self.batchnorm_channels))
        if any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.batchnorm_channels
        ):
            raise ConfigError(
                f"CostModel(batchnorm_channels={self.batchnorm_channels!r}): each BatchNorm "
                "layer's channels, ints >= 1"
            )
        if isinstance(self.gradient_bytes, bool) or not isinstance(self.gradient_bytes, int):
            raise ConfigError(f"CostModel(gradient_bytes={self.gradient_bytes!r}): an int")
        if self.gradient_bytes < 0:
            raise ConfigError(f"CostModel(gradient_bytes={self.gradient_bytes}): must be >= 0")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ConfigError(f"CostModel(bucket_bytes={self.bucket_bytes!r}): an int >= 1")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"CostModel(overlap={self.overlap}): must be in [0, 1]")
        if self.load_samples_per_s is not None and not self.load_samples_per_s > 0:
            raise ConfigError(
                f"CostModel(load_samples_per_s={self.load_samples_per_s}): > 0 or None"
            )
        for name in ("window_overhead_s", "phase_overhead_s", "sync_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"CostModel({name}={getattr(self, name)}): must be >= 0")
        if not self.window_seconds > 0:
            raise ConfigError(f"CostModel(window_seconds={self.window_seconds}): must be > 0")
        if self.window_steps is not None and self.window_steps < 1:
            raise ConfigError(f"CostModel(window_steps={self.window_steps}): >= 1 or None")

    def replace(self, **changes: Any) -> CostModel:
        """A copy with some terms changed (e.g. ``topology=``, ``bucket_bytes=``)."""
        return dataclasses.replace(self, **changes)

    def with_network(self, inter: Link, *, per_node: int | None = None) -> CostModel:
        """This model on several nodes joined by ``inter`` (e.g.
        ``presets.interconnect("ib-hdr")``): what a calibration on one node needs before
        it predicts more replicas than one node holds. ``per_node``: replicas per node
        (default: the calibrated node's, at least 1)."""
        topology = self.topology
        per_node = per_node or topology.per_node or 1
        new = Topology(
            intra=topology.intra, inter=inter, per_node=per_node, algorithm=topology.algorithm
        )
        notes = {**self.notes, "inter": f"{inter.name or 'link'}: {inter.source or 'given'}"}
        return self.replace(topology=new, notes=notes)

    # -- predictions ---------------------------------------------------------------------

    def breakdown(
        self,
        *,
        replicas: int,
        global_batch: int,
        local_batches: Sequence[int] | None = None,
    ) -> StepBreakdown:
        """One step of ``global_batch`` on ``replicas`` (split evenly, or as
        ``local_batches`` when the balancer split it unevenly)."""
        _check_counts(replicas, global_batch)
        if local_batches is not None:
            if len(local_batches) != replicas or sum(local_batches) != global_batch:
                raise ConfigError(
                    f"local_batches={list(local_batches)} must hold {replicas} batches "
                    f"summing to global_batch={global_batch}"
                )
            local = max(local_batches)
        else:
            local = math.ceil(global_batch / replicas)
        compute_s, micro = self.compute.micro_batched_seconds(local, self.max_micro_batch)
        compute_s *= self.compute.slowdown(self.topology.local(replicas))
        load_s = 0.0 if self.load_samples_per_s is None else local / self.load_samples_per_s
        # the hooks reduce during the last micro-batch's backward
        backward_s = self.compute.backward_fraction * compute_s / max(1, micro)
        buckets = bucket_sizes(self.gradient_bytes, self.bucket_bytes, FIRST_BUCKET_BYTES)
        total, exposed = exposed_allreduce_seconds(
            buckets, replicas, self.topology, backward_s, self.overlap
        )
        sync = self.sync_overhead_s if replicas > 1 else 0.0
        batchnorm = micro * self.batchnorm_seconds(replicas)
        inner = max(compute_s, load_s) + exposed + batchnorm + sync
        if self.window_steps is not None:
            per_window = self.window_steps
        else:
            per_window = max(1, math.ceil(self.window_seconds / inner)) if inner > 0 else 1
        return StepBreakdown(
            replicas=replicas,
            global_batch=global_batch,
            local_batch=local,
            micro_batches=micro,
            compute_s=compute_s,
            data_wait_s=max(0.0, load_s - compute_s),
            allreduce_s=total,
            allreduce_exposed_s=exposed,
            overhead_s=self.window_overhead_s / per_window,
            steps_per_window=per_window,
            sync_s=sync,
            batchnorm_s=batchnorm,
        )

    def batchnorm_seconds(self, replicas: int) -> float:
        """``sync_batchnorm``'s reductions in one forward and backward on ``replicas``: per
        BatchNorm layer, the moments' allreduce (``2C`` float64 sums) and the adjoint's
        (``2C`` float32); α-dominated for any real layer."""
        if replicas <= 1:
            return 0.0
        return sum(
            allreduce_seconds(8 * 2 * c, replicas, self.topology)
            + allreduce_seconds(4 * 2 * c, replicas, self.topology)
            for c in self.batchnorm_channels
        )

    def step_seconds(self, *, replicas: int, global_batch: int) -> float:
        return self.breakdown(replicas=replicas, global_batch=global_batch).step_s

    def throughput(self, *, replicas: int, global_batch: int) -> float:
        """Samples per second of the whole fit (all replicas)."""
        return self.breakdown(replicas=replicas, global_batch=global_batch).samples_per_second

    def efficiency(
        self,
        *,
        replicas: int,
        global_batch: int | None = None,
        local_batch: int | None = None,
    ) -> float:
        """Weak-scaling efficiency at a fixed local batch: throughput at ``replicas`` over
        ``replicas`` × the throughput of one replica at the same local batch. Give the
        local batch, or the global batch (local = global / replicas)."""
        if (global_batch is None) == (local_batch is None):
            raise ConfigError("efficiency(): give exactly one of global_batch or local_batch")
        local = local_batch if local_batch is not None else math.ceil(global_batch / replicas)
        one = self.throughput(replicas=1, global_batch=local)
        many = self.throughput(replicas=replicas, global_batch=local * replicas)
        return many / (replicas * one)

    def schedule_efficiency(
        self, *, replicas: int, phases: Sequence[tuple[int, int]]
    ) -> dict[str, float]:
        """A variable-batch schedule on ``replicas``: ``phases`` is ``[(global batch,
        samples trained at it), ...]``. Efficiency is the time ``replicas`` ideal
        replicas would take (each as fast alone at its local batch) over the predicted
        time, phase overheads included."""
        if not phases:
            raise ConfigError("schedule_efficiency(phases=[]): give [(global_batch, samples)]")
        actual = ideal = samples_total = 0.0
        for batch, samples in phases:
            local = math.ceil(batch / replicas)
            actual += samples / self.throughput(replicas=replicas, global_batch=batch)
            actual += self.phase_overhead_s
            ideal += samples / (replicas * self.throughput(replicas=1, global_batch=local))
            samples_total += samples
        return {
            "efficiency": ideal / actual,
            "seconds": actual,
            "samples_per_second": samples_total / actual,
        }

    def memory_bytes(self, *, replicas: int, global_batch: int) -> dict[str, int]:
        """Bytes one replica holds at this batch (largest share, one micro-batch), with
        the ``total``; needs ``memory``."""
        if self.memory is None:
            raise ConfigError(
                "this cost model has no memory terms; calibrate it from a pipeline "
                "(dataflow.costmodel.calibrate) or give CostModel(memory=MemoryModel(...))"
            )
        local = math.ceil(global_batch / replicas)
        micro = local if self.max_micro_batch is None else min(local, self.max_micro_batch)
        parts = self.memory.bytes_per_replica(micro)
        parts["total"] = sum(parts.values())
        return parts

    # -- save and load -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        try:
            values = dict(data)
            compute = dict(values.pop("compute"))
            compute["points"] = tuple(tuple(p) for p in compute["points"])
            compute["shared"] = tuple(tuple(p) for p in compute.get("shared", ()))
            topo = dict(values.pop("topology"))
            topo["intra"] = Link(**topo["intra"])
            topo["inter"] = None if topo.get("inter") is None else Link(**topo["inter"])
            memory = values.pop("memory", None)
            return cls(
                compute=ComputeFit(**compute),
                topology=Topology(**topo),
                memory=None if memory is None else MemoryModel(**memory),
                **values,
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(
                f"not a saved CostModel ({exc}); write one with CostModel.save(path)"
            ) from exc

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no cost model file at {path}; save one with CostModel.save")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not JSON ({exc}); save one with CostModel.save") from exc
        return cls.from_dict(data)


def _check_counts(replicas: object, global_batch: object) -> None:
    for name, value in (("replicas", replicas), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
