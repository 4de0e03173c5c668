"""What a replica is built from (``ReplicaSpec``, sent once per fit), the parts of its
state that commits, rollbacks, joiners and checkpoints move (``ReplicaState``), and
the device it runs on."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dataflow.graph import Graph
from dataflow.runtime.plugin import running_plugin


@dataclass
class ReplicaState:
    """Parts of a replica's state, in host memory (None: not captured): weights,
    optimizer state, stage settings (the LR ramp), random state, buffers."""

    model: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None
    stages: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    buffers: dict[str, torch.Tensor] | None = None
    loss_scale: dict[str, Any] | None = None  # fp16's LossScale.state_dict()
    # the copies' end (a CUDA event) while they may still run (runtime.host_copies): settle()
    # before reading, or sending, the tensors
    pending: Any = field(default=None, compare=False, repr=False)

    def settle(self) -> ReplicaState:
        """Wait for the copies into this state's tensors to end (at once if they have)."""
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None
        return self


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a worker needs to build its replica; sent once per fit."""

    run_id: str
    graph: Graph
    order: tuple[str, ...]
    seed: int
    device: str = "auto"
    threads: int | None = None
    collective_timeout_s: float = 300.0
    relax_malloc: bool = True
    freeze_gc: bool = True
    pause_dask_profiler: bool = True
    throttle: dict[int, Any] = field(default_factory=dict)  # rank -> runtime.throttle.Slowdown
    started_at: float = 0.0  # the driver's time.time() at the fit's start (slow-down clock)
    commit_windows: bool = True  # keep the state at each window's start, to roll back to
    layout: Any = (
        None  # dataflow.planning.layout.Layout; spatial > 1: a replica is a group of workers
    )
    local: Any = None  # a dataflow.sync.Local: local steps, a weighted average per window
    asynchronous: Any = None  # a dataflow.sync.Async: a parameter store, bounded staleness
    # requested step options (dataflow.core.precision), resolved by each worker
    precision: str = "fp32"
    channels_last: bool | str = False
    compile: bool | str = False
    allow_cpu_fp16: bool = False  # DATAFLOW_ALLOW_CPU_FP16=1 on the driver (tests only)
    capture: bool = False  # steady steps replayed as CUDA graphs (stages/capture.py)
    simulate_capture: bool = False  # DATAFLOW_SIMULATE_CAPTURE=1 on the driver (tests only)
    # the allreduce bucket the fit planned (driver/fit_settings); a stage's own wins
    bucket_mb: float | None = None
    # keep_best watches the weights' moving average (an eval_ema_ metric): the weights
    # kept at an epoch's end are the average's
    keep_average: bool = False

    @property
    def requested_step_options(self) -> tuple[Any, ...]:
        """What Forward resolves on the worker (``dataflow.core.precision``)."""
        return (
            self.precision,
            self.channels_last,
            self.compile,
            self.allow_cpu_fp16,
            self.capture,
            self.simulate_capture,
        )

    @property
    def spatial(self) -> int:
        return self.layout.spatial if self.layout is not None else 1

    def private(self) -> ReplicaSpec:
        """A copy whose stages one replica may change (their ``setup`` does: a spatial
        rank's region of the source, data moved to the device), sharing the sources'
        arrays. The spec is scattered once and kept on the workers: the copy a worker
        holds stays as sent, for a later Setup there and for the workers that fetch it
        from there (a joiner, after a recovery)."""
        memo: dict[int, Any] = {id(a): a for a in source_arrays(self.graph)}
        return copy.deepcopy(self, memo)


def source_arrays(graph: Graph) -> list[Any]:
    """The arrays (tensors, numpy) held by the graph's in-memory sources (an object with
    ``read`` and ``num_samples``, e.g. ArraySource's x and y): data, never copied."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 4 or isinstance(obj, torch.Tensor | np.ndarray):
            return
        seen.add(id(obj))
        if isinstance(obj, list | tuple | set | frozenset):
            values: Any = obj
        elif isinstance(obj, dict):
            values = obj.values()
        else:
            values = getattr(obj, "__dict__", {}).values()
        source = callable(getattr(obj, "read", None)) and hasattr(obj, "num_samples")
        for value in values:
            if source and isinstance(value, torch.Tensor | np.ndarray):
                found.append(value)
            else:
                visit(value, depth + 1)

    for stage in graph:
        visit(stage, 0)
    return found


def resolve_device(requested: str, rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", gpu_index(rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def gpu_index(rank: int) -> int:
    """The GPU this process trains on: its only one; in a Dask worker that sees several,
    the one it claimed for its life (``runtime/gpu_claim.py``: distinct per worker on a
    host, whatever the rank); else (the driver, no lock to take) ``rank`` modulo the
    GPUs seen."""
    count = max(1, torch.cuda.device_count())
    if count > 1:
        plugin = running_plugin()
        claim = None if plugin is None else plugin.gpu.get()
        if claim is not None:
            return claim.index
    return rank % count
