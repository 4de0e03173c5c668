"""The driver's half of checkpoints: what it writes at a phase boundary and inside a
phase, and where a fit resumed from one starts."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataflow.checkpoint import Checkpoint, ledger_state, phase_from_dict, phase_to_dict
from dataflow.checkpoint.progress import PhaseProgress
from dataflow.checkpoint.store import STEPS_COUNT
from dataflow.core.phase import PhaseMeasurement, PhaseSpec
from dataflow.core.plain import to_plain
from dataflow.core.rng import capture_rng
from dataflow.history.records import plain_rows


@dataclass(frozen=True)
class ResumePoint:
    """Where a fit starts: ``epoch`` and the ``previous`` phase with its ``measurement``
    (at a phase boundary), the first step to run, and inside a phase its ``progress``."""

    epoch: int = 0
    previous: PhaseSpec | None = None
    step: int = 0
    measurement: PhaseMeasurement | None = None
    progress: PhaseProgress | None = None
    memory_cap: int | None = None  # the micro-batch cap the fit had learned

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> ResumePoint:
        state = checkpoint.schedule_state
        cap = state.get("memory_cap")  # (absent from checkpoints before it was kept)
        if checkpoint.mid_phase:
            progress = PhaseProgress.from_dict(checkpoint.in_phase)
            return cls(progress.phase.start_epoch, None, checkpoint.step, None, progress, cap)
        measured = state.get("measurement")
        return cls(
            checkpoint.epoch,
            phase_from_dict(state.get("previous")),
            checkpoint.step,
            None if measured is None else PhaseMeasurement(**measured),
            memory_cap=cap,
        )


class CheckpointWriter:
    """Writes a fit's checkpoints to ``store``; ``fingerprint`` ties them to the fit."""

    def __init__(self, store: Any, fingerprint: dict[str, Any]) -> None:
        self.store, self.fingerprint = store, fingerprint
        self.saved_steps = 0  # history steps already in the store's steps file

    def load_latest(self) -> Checkpoint | None:
        return self.store.load_latest(self.fingerprint)

    def save_boundary(
        self,
        states: list[dict],
        phase: Any,
        next_step: int,
        measurement: Any,
        recorder: Any,
        memory_cap: int | None = None,
    ) -> Path:
        """At a phase boundary: rank 0's synchronized weights and optimizer state, every
        replica's random state, and the driver's schedule, ledger and history, with the
        micro-batch cap out-of-memory errors taught the fit."""
        schedule_state = {
            "previous": phase_to_dict(phase),
            "measurement": dataclasses.asdict(measurement),
            "memory_cap": memory_cap,
        }
        return self._write(states, phase, phase.end_epoch, next_step, schedule_state, recorder)

    def save_mid_phase(
        self, states: list[dict], phase: Any, position: Any, step: int, recorder: Any
    ) -> Path:
        """Inside ``phase``, at the committed ``step``: what a boundary checkpoint saves,
        and where the phase stands (``position``, the command's ``PhasePosition``, as
        :class:`PhaseProgress`) so a resume goes on from there."""
        epoch = next(spec.epoch for spec in position.phase_steps if spec.index == step)
        progress = PhaseProgress(
            phase=phase,
            steps=position.phase_steps,
            segment=position.segment,
            lr_factor=position.lr_factor,
            rollbacks=position.rollbacks,
            norm_pairs=list(recorder.phase_pairs),
            epoch_loss=(recorder.epoch_loss_sum, recorder.epoch_samples),
            totals=list(recorder.totals),
            seconds=time.perf_counter() - recorder.phase_started,
            lost=list(recorder.lost_replicas),
        )
        schedule_state = {"memory_cap": position.memory_cap}
        return self._write(states, phase, epoch, step, schedule_state, recorder, progress)

    def _write(
        self,
        states: list[dict],
        phase: Any,
        epoch: int,
        step: int,
        schedule_state: dict[str, Any],
        recorder: Any,
        progress: PhaseProgress | None = None,
    ) -> Path:
        """``states``: each replica's ReplicaState, rank 0's with the weights."""
        started = time.perf_counter()
        leader = states[0]
        recorder.record_segments(step)  # the runs so far, this one up to ``step``
        path = self.store.save(
            Checkpoint(
                model_state=leader.model or {},
                optimizer_state=leader.optimizer or {},
                stage_state={k: v for k, v in (leader.stages or {}).items() if v is not None},
                phase_index=phase.index,
                epoch=epoch,
                step=step,
                schedule_state={**schedule_state, "noise": recorder.noise.state_dict()},
                ledger=ledger_state(recorder.ledger),
                rng=capture_rng(),
                replica_rng=[s.rng for s in states],
                replica_buffers=[s.buffers or {} for s in states],
                history=self._history(recorder.history),
                fingerprint=self.fingerprint,
                in_phase=None if progress is None else progress.to_dict(),
            )
        )
        self.saved_steps = len(recorder.history.steps)
        recorder.checkpoint_written(
            path, phase.index, step, progress is not None, time.perf_counter() - started
        )
        return path

    def _history(self, history: Any) -> dict[str, Any]:
        """The history for a checkpoint: its new steps appended to the store's steps
        file (each step serialised once per fit), the rest (epochs, phases, info: small)
        inline, with how many steps it covers."""
        steps = history.steps
        new = to_plain(plain_rows(steps[self.saved_steps :]), where="History.steps")  # NaN: float
        count = self.store.append_steps(self.saved_steps, new)
        rest = {
            "epochs": plain_rows(history.epochs),
            "phases": plain_rows(history.phases),
            "info": history.info,
        }
        return {**to_plain(rest, where="History"), STEPS_COUNT: count}
