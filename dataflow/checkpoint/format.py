"""The checkpoint format: a :class:`Checkpoint`, its version, and the helpers that
turn the state that is not a plain dict (PhaseSpecs, StepSpecs, the sample ledger)
into plain data and back.

A checkpoint holds tensors and plain containers only (numbers, strings, lists,
tuples, dicts), so it loads with ``torch.load(weights_only=True)``: opening one
never runs code from the file. ``dataflow.checkpoint`` is the one import for users.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dataflow.core.errors import CheckpointError, ConfigError
from dataflow.core.phase import PhaseSpec
from dataflow.core.plain import NotPlainError, to_plain
from dataflow.core.step import StepSpec
from dataflow.io.ledger import SampleLedger

# 2: mid-phase checkpoints (in_phase, stage_state, replica_buffers); 3: the history's
# steps live in the store's steps file, appended once (history["steps_in_file"])
FORMAT_VERSION = 3


# -- the checkpoint ----------------------------------------------------------------------
@dataclass(kw_only=True)
class Checkpoint:
    """The state of a fit at the start of global step ``step`` (nothing of it run yet).

    ``schedule_state``: ``{"previous": phase_to_dict(previous PhaseSpec) or None, ...}``
    plus the state dicts of any schedule helper (e.g. ``"noise": tracker.state_dict()``)
    and ``"memory_cap"``, the micro-batch cap out-of-memory errors taught the fit.
    ``ledger``: :func:`ledger_state`. ``rng``: the driver's :func:`capture_rng`;
    ``replica_rng``: one :func:`capture_rng` per replica, taken on its worker.

    ``stage_state``: rank 0's stage settings (:meth:`Stage.phase_state`, e.g. the LR
    ramp); ``replica_buffers``: each replica's buffers (BatchNorm statistics, which
    differ between replicas until a phase ends). ``in_phase``: None at a phase
    boundary; mid-phase, where the fit stands inside the phase
    (:class:`dataflow.checkpoint.progress.PhaseProgress`).
    """

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    phase_index: int
    epoch: int
    step: int
    schedule_state: dict[str, Any] = field(default_factory=dict)
    ledger: dict[str, Any] | None = None
    rng: dict[str, Any] = field(default_factory=dict)
    replica_rng: list[dict[str, Any]] = field(default_factory=list)
    history: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    stage_state: dict[str, Any] = field(default_factory=dict)
    replica_buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    in_phase: dict[str, Any] | None = None
    created: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("phase_index", "epoch", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"Checkpoint: {name} must be an int >= 0, got {value!r}")
        if not isinstance(self.model_state, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in self.model_state.values()
        ):
            raise ConfigError(
                "Checkpoint: model_state must be a state_dict (names -> tensors), e.g. "
                "model.state_dict()"
            )
        if not isinstance(self.optimizer_state, Mapping):
            raise ConfigError(
                f"Checkpoint: optimizer_state must be optimizer.state_dict(), got "
                f"{type(self.optimizer_state).__name__}"
            )
        for name in ("schedule_state", "rng", "history", "fingerprint", "stage_state"):
            if not isinstance(getattr(self, name), Mapping):
                raise ConfigError(f"Checkpoint: {name} must be a dict")
        if self.in_phase is not None and not isinstance(self.in_phase, Mapping):
            raise ConfigError("Checkpoint: in_phase must be None or a dict")

    @property
    def mid_phase(self) -> bool:
        """Written inside a phase (every N windows, or before WorkerLostError)."""
        return self.in_phase is not None

    def to_dict(self) -> dict[str, Any]:
        """Plain containers and tensors only (what ``torch.load(weights_only=True)`` reads);
        raises ``CheckpointError`` naming the first field that holds anything else."""
        return {
            f.name: plain_state(getattr(self, f.name), f.name) for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], *, source: str = "checkpoint") -> Checkpoint:
        """The checkpoint :meth:`to_dict` wrote, by this version or an older one; keys this
        version does not have are ignored (older files hold ``balancer_measured`` and
        ``extra``, which nothing reads any more)."""
        version = state.get("format_version") if isinstance(state, Mapping) else None
        if not isinstance(version, int):
            raise CheckpointError(f"{source} is not a dataflow checkpoint (no format_version)")
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format version {version}, newer than this dataflow reads "
                f"({FORMAT_VERSION}); upgrade dataflow to resume from it"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in state.items() if k in names})
        except (TypeError, ConfigError) as error:
            raise CheckpointError(f"{source} is malformed: {error}") from error


def plain_state(value: Any, where: str, *, json: bool = False) -> Any:
    """:func:`dataflow.core.plain.to_plain` for the field ``where`` of a checkpoint (the
    stored form; ``json=True`` for its manifest); what it refuses raises
    ``CheckpointError`` naming ``Checkpoint.<where>`` and the path inside it."""
    try:
        return to_plain(value, where=f"Checkpoint.{where}", json=json)
    except NotPlainError as error:
        raise CheckpointError(
            f"{error}: a checkpoint stores nothing else, so that it loads with "
            "weights_only=True (for a PhaseSpec: dataflow.checkpoint.phase_to_dict)"
        ) from error


# -- helpers for the state that is not a plain dict --------------------------------------
def phase_to_dict(phase: Any) -> dict[str, Any] | None:
    """A PhaseSpec (or any dataclass) as a dict of its fields; None stays None."""
    return None if phase is None else dataclasses.asdict(phase)


def phase_from_dict(state: Mapping[str, Any] | None) -> Any:
    """The PhaseSpec that :func:`phase_to_dict` saved (None stays None)."""
    return None if state is None else PhaseSpec(**state)


def steps_to_list(steps: Any) -> list[dict[str, Any]]:
    """StepSpecs as dicts of plain values (tuples stay tuples)."""
    return [dataclasses.asdict(spec) for spec in steps]


def steps_from_list(items: Any) -> tuple[Any, ...]:
    """The StepSpecs :func:`steps_to_list` saved."""

    def tuples(value: Any) -> Any:
        return tuple(tuples(v) for v in value) if isinstance(value, list | tuple) else value

    return tuple(StepSpec(**{key: tuples(value) for key, value in item.items()}) for item in items)


def ledger_state(ledger: Any) -> dict[str, Any]:
    """A SampleLedger as packed bitmaps (one bit per sample per epoch and replica),
    through its public API: ``num_samples``, ``epochs``, ``replicas(e)``, ``consumed(e, r)``."""
    records = []
    for epoch in ledger.epochs:
        for replica in ledger.replicas(epoch):
            mask = np.zeros(ledger.num_samples, dtype=bool)
            mask[ledger.consumed(epoch, replica)] = True
            records.append((int(epoch), int(replica), torch.from_numpy(np.packbits(mask))))
    return {"num_samples": int(ledger.num_samples), "records": records}


def ledger_from_state(state: Mapping[str, Any]) -> Any:
    """The SampleLedger that :func:`ledger_state` saved."""
    ledger = SampleLedger(int(state["num_samples"]))
    for epoch, replica, packed in state["records"]:
        mask = np.unpackbits(packed.numpy(), count=ledger.num_samples).astype(bool)
        ledger.record(epoch, replica, np.flatnonzero(mask))
    return ledger
