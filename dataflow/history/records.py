"""The history's schema: one typed record per step, epoch and phase.

The recorder writes these and the report reads them (its required fields are the
records' fields). Each record also reads as a dict (``history.steps[i]["loss"]``,
``.get``, ``in``, ``==`` with a dict). A history loaded from JSON or a checkpoint holds
records too (:meth:`Record.from_dict`): one type whatever the path, and each loaded row
reads key for key as written, an older row's absent fields absent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

_ABSENT = object()


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


# Strict JSON (History.to_json) writes NaN and infinities as these strings
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _as_float(cls: type, key: str, value: Any) -> Any:
    """``value``, or the float a strict-JSON string stands for in a float field."""
    if isinstance(value, str) and key in cls.float_fields:  # type: ignore[attr-defined]
        return _NON_FINITE.get(value, value)
    return value


class Record(Mapping[str, Any]):
    """A dataclass that reads as a mapping of its fields (``None`` optional fields left
    out, as the JSON of older histories leaves them out)."""

    optional: ClassVar[tuple[str, ...]] = ()  # fields left out of the mapping when None
    float_fields: ClassVar[tuple[str, ...]] = ()  # read back from strict JSON's "nan"
    # Set by ``from_dict``: the fields its row did not have (left out of the mapping, so a
    # loaded row reads exactly as written), and keys that are no field (kept as they are)
    _absent: frozenset[str] = frozenset()
    _extra: Mapping[str, Any] = MappingProxyType({})

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Any:
        """The record of ``row`` (a dict of a history loaded from JSON or a checkpoint):
        attribute access as on a fit's own records; reads as ``row`` did, key for key."""
        if isinstance(row, cls):
            return row
        names = _field_names(cls)
        known = {k: _as_float(cls, k, v) for k, v in row.items() if k in names}
        absent = frozenset(f.name for f in dataclasses.fields(cls) if f.name not in row)
        # required fields an older row lacks read as None (and stay absent from the mapping)
        missing = {
            f.name: None for f in dataclasses.fields(cls) if _required(f) and f.name in absent
        }
        record = cls(**known, **missing)
        record._absent = absent
        extra = {k: v for k, v in row.items() if k not in names}
        if extra:
            record._extra = extra
        return record

    def _names(self) -> list[str]:
        return [
            *(
                f.name
                for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if not (f.name in self.optional and getattr(self, f.name) is None)
                and f.name not in self._absent
            ),
            *self._extra,
        ]

    def __getitem__(self, key: str) -> Any:
        if key in self._extra:
            return self._extra[key]
        value = getattr(self, key, _ABSENT) if key in _field_names(type(self)) else _ABSENT
        if value is _ABSENT or (value is None and key in self.optional) or key in self._absent:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def to_dict(self) -> dict[str, Any]:
        return {key: self[key] for key in self}

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The fields every record has (what the report needs)."""
        return tuple(
            f.name
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.name not in cls.optional
        )


@dataclasses.dataclass(eq=False)
class StepRecord(Record):
    """One committed global step: its loss (sample-weighted mean over the replicas),
    samples, the slowest replica's seconds, and the wall time since training began;
    ``skipped``: True when its update was dropped as not finite (``on_non_finite="skip"``;
    under local or asynchronous updates, some replica's part of it), else absent;
    ``lr``: the learning rate its update ran at (the first param group's);
    ``grad_norm`` (with ``clip_grad_norm=``): the norm of the gradient before clipping,
    of the global batch's under synchronous updates (under local or asynchronous ones,
    the replicas' own, weighted by their samples), else absent."""

    step: int
    phase: int
    epoch: int
    loss: float
    samples: int
    seconds: float
    time: float
    skipped: bool | None = None
    lr: float | None = None
    grad_norm: float | None = None
    optional: ClassVar[tuple[str, ...]] = ("skipped", "lr", "grad_norm")
    float_fields: ClassVar[tuple[str, ...]] = ("loss", "seconds", "time")


@dataclasses.dataclass(eq=False)
class EpochRecord(Record):
    """One epoch: the mean training loss, each evaluation metric (``eval_<name>``) and
    how many held-out samples the evaluation scored (``held_out_samples``: the whole
    held-out set, each sample once, replicas lost or not; absent without one)."""

    epoch: int
    train_loss: float
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    held_out_samples: int | None = None
    optional: ClassVar[tuple[str, ...]] = ("held_out_samples",)
    float_fields: ClassVar[tuple[str, ...]] = ("train_loss",)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> EpochRecord:
        """As :meth:`Record.from_dict`; every key but the fields is a metric."""
        if isinstance(row, cls):
            return row
        fields = ("epoch", "train_loss", "held_out_samples")
        metrics = {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v
                   for k, v in row.items() if k not in fields}  # fmt: skip
        record = cls(
            row.get("epoch"),  # type: ignore[arg-type]
            _as_float(cls, "train_loss", row.get("train_loss")),
            metrics,
            row.get("held_out_samples"),
        )
        record._absent = frozenset(k for k in ("epoch", "train_loss") if k not in row)
        return record

    def _names(self) -> list[str]:
        counted = [] if self.held_out_samples is None else ["held_out_samples"]
        present = [k for k in ("epoch", "train_loss") if k not in self._absent]
        return [*present, *self.metrics, *counted]

    def __getitem__(self, key: str) -> Any:
        if key in self.metrics:
            return self.metrics[key]
        if (key in ("epoch", "train_loss") and key not in self._absent) or (
            key == "held_out_samples" and self.held_out_samples is not None
        ):
            return getattr(self, key)
        raise KeyError(key)

    @classmethod
    def required(cls) -> tuple[str, ...]:
        return ("epoch", "train_loss")


@dataclasses.dataclass(eq=False)
class PhaseRecord(Record):
    """One phase: its batch, LR and split, what each replica measured (samples/s, time
    per stage, data wait), the noise scale a measuring schedule chose it from, and its
    steady step time next to the cost model's prediction."""

    phase: int
    start_epoch: int
    end_epoch: int
    global_batch: int
    lr: float | None
    local_batches: list[int]
    samples_per_second: list[float]
    steps: int
    seconds: float
    stage_seconds: list[dict[str, float]]
    replicas: int = 1
    micro_batches: list[int] | None = None
    noise_scale: float | None = None  # the estimate this phase was chosen from
    gain: float | None = None  # the LR gain applied (Adaptive, Stepwise's AdaScale rules)
    measured_noise_scale: float | None = None  # after this phase's steps
    windows: int = 0
    task_seconds: list[float] | None = None
    data_wait_fraction: list[float] | None = None  # per replica: share of step time in Load
    chunks_decoded: list[int] | None = None
    peak_buffered_samples: list[int] | None = None
    # per replica: reads sent again to a store that failed in a way that passes
    # (throttling, a server error, a dropped connection; ``io.store_retry``)
    store_retries: list[int] | None = None
    skipped_steps: int = 0  # non-finite, dropped (the committed steps marked ``skipped``)
    # The phase's steady step time on the driver's clock (the recorder's
    # ``steady_step_seconds``: window commits after the phase's first windows), and,
    # with a cost model, its prediction (``StepBreakdown.to_dict()``) for this phase.
    measured_step_seconds: float | None = None
    # why the steady step time was not used (implausible: ``plausible_step_seconds``)
    measured_step_note: str | None = None
    predicted: dict[str, Any] | None = None
    # Local updates: per replica, the seconds synchronous (lockstep) steps would have
    # waited for the slowest replica in this phase, from each step's measured times
    lockstep_wait_s: list[float] | None = None
    # Asynchronous updates: per replica, the pushes the parameter store applied at each
    # staleness (``staleness_counts[r][τ]``; their sum is the replica's pushes)
    staleness_counts: list[list[int]] | None = None
    # Per replica, the samples it trained in the phase's committed steps: the phase's
    # last replicas in rank order, then those lost during the phase (``lost_replicas``
    # says which workers, in the same order); together they sum to the phase's steps'.
    samples_trained: list[int] | None = None
    lost_replicas: list[dict[str, Any]] | None = None
    # compile=...: per replica, seconds of the calls that compiled a new input shape,
    # and how many shapes were compiled in this phase (0: the compiled code was reused)
    compile_seconds: list[float] | None = None
    compiled_shapes: list[int] | None = None
    # capture=True: per replica, seconds spent capturing CUDA graphs in this phase, the
    # graphs captured (one per input shape; a micro-batched step's first and later
    # micro-batches are two), and the steps that ran as graph replays, every micro-batch
    # of them (the rest ran eagerly: each shape's warm-up, short last steps); why a
    # shape could not be captured (it then runs eagerly)
    capture_seconds: list[float] | None = None
    captured_shapes: list[int] | None = None
    captured_steps: list[int] | None = None
    capture_failures: list[str] | None = None
    # precision="fp16": steps skipped because the scaled gradient overflowed (not a
    # non-finite failure), and the loss scale at the phase's end (alike on all replicas)
    overflow_steps: int | None = None
    loss_scale: float | None = None
    # Local updates: at each average of the phase, how far the replicas' weights had
    # drifted apart, sum_r w_r |θ_r − θ̄|² / |θ̄|² (``stages.allreduce.weights_drift``)
    drift: list[float] | None = None
    # scale_invariant=True (Stepwise, Adaptive): the progress (epochs at the first batch) made
    # before the phase and after it
    progress_start: float | None = None
    progress_end: float | None = None
    # left out when None (older histories have none)
    optional: ClassVar[tuple[str, ...]] = (
        "measured_step_seconds",
        "measured_step_note",
        "predicted",
        "lockstep_wait_s",
        "staleness_counts",
        "samples_trained",
        "lost_replicas",
        "compile_seconds",
        "compiled_shapes",
        "capture_seconds",
        "captured_shapes",
        "captured_steps",
        "capture_failures",
        "overflow_steps",
        "loss_scale",
        "drift",
        "progress_start",
        "progress_end",
    )

    @property
    def pushes(self) -> list[int] | None:
        """Asynchronous updates: the pushes each replica made in the phase."""
        if self.staleness_counts is None:
            return None
        return [sum(counts) for counts in self.staleness_counts]

    @classmethod
    def required(cls) -> tuple[str, ...]:
        return (
            "phase", "start_epoch", "end_epoch", "global_batch", "lr", "local_batches",
            "samples_per_second", "steps", "seconds", "stage_seconds",
        )  # fmt: skip


@dataclasses.dataclass(eq=False)
class CheckpointRecord(Record):
    """One entry of ``history.info["checkpoints"]``: a checkpoint written, where the fit
    stood (``step``: the first step it has not trained; ``mid_phase``: inside ``phase``,
    not at its end) and how long writing it took."""

    path: str
    phase: int
    step: int
    mid_phase: bool
    seconds: float


@dataclasses.dataclass(eq=False)
class FailureRecord(Record):
    """One entry of ``history.info["failures"]``: what failed and where the fit stood
    (``reason``: "lost workers", "every replica lost", "out-of-memory", "non-finite",
    "stalled" (a collective timed out on a live, slow peer), "slow replica dropped" (it
    stalled the phase past ``max_stalls``) or "a worker failed to set up";
    ``commit_step``: the step it went on from; ``window_steps_lost``: the steps trained
    again), then how it went on (``replicas_after``, ``joined``, ``resumed_at``, ...).
    The machine builds it, the loop completes it as the recovery goes on (``update``,
    item assignment of a field), and it reads as a dict like the other records."""

    reason: str
    phase: int | None
    commit_step: int
    lost: list[str] = dataclasses.field(default_factory=list)
    replicas_before: int | None = None
    window_steps_lost: int | None = None
    replicas_after: int | None = None
    joined: list[str] | None = None
    # asynchronous updates: the survivors finished the window in flight (True once it
    # committed) and trained these parts of the lost replicas again
    kept_window: bool | None = None
    retrained_parts: int | None = None
    error: str | None = None  # out-of-memory, non-finite: the error's message
    rank: int | None = None  # out-of-memory: the replica, what it held, the new cap
    slow_replicas: list[int] | None = None  # stalled: those still in their step
    micro_batch: int | None = None
    micro_batch_cap: int | None = None
    lr_factor: float | None = None  # non-finite: the phase's LR factor after the cut
    restarted_from_step: int | None = None  # every replica lost: the checkpoint's step
    detected_at: float | None = None  # wall clock (time.time()) of the detection
    resumed_at: float | None = None  # ... and of training going on
    optional: ClassVar[tuple[str, ...]] = (
        "replicas_before", "window_steps_lost", "replicas_after", "joined", "kept_window",
        "retrained_parts", "error", "rank", "slow_replicas", "micro_batch", "micro_batch_cap",
        "lr_factor",
        "restarted_from_step", "detected_at", "resumed_at",
    )  # fmt: skip

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _field_names(type(self)):
            raise KeyError(f"FailureRecord has no field {key!r}")
        setattr(self, key, value)

    def update(self, other: Mapping[str, Any] = (), **fields: Any) -> None:  # type: ignore[assignment]
        for key, value in {**dict(other), **fields}.items():
            self[key] = value

    def copy(self) -> FailureRecord:
        return dataclasses.replace(self, lost=list(self.lost))


def typed_rows(cls: type[Record], rows: list[Any]) -> list[Any]:
    """Rows of a loaded history (dicts) as ``cls`` records, as a fit's own rows are."""
    return [cls.from_dict(row) if isinstance(row, Mapping) else row for row in rows]


def plain_rows(rows: list[Any]) -> list[Any]:
    """Records as dicts (JSON, checkpoints); dicts (older histories) as they are."""
    return [row.to_dict() if isinstance(row, Record) else row for row in rows]
