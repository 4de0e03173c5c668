"""Where a fit stands inside a phase: what a mid-phase checkpoint must hold so the
driver can go on from its step as if it had never stopped.

Pure data: the driver builds a :class:`PhaseProgress` when it writes a checkpoint
inside a phase (every ``checkpoint_every`` windows, or before raising
``WorkerLostError``) and reads one back on ``fit(resume=True)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dataflow.checkpoint import phase_from_dict, phase_to_dict, steps_from_list, steps_to_list
from dataflow.core.phase import PhaseSpec
from dataflow.core.step import StepSpec


@dataclass
class ReplicaTotals:
    """One replica's work in a phase, summed over its windows (what the history's phase
    record and the balancer need; the windows themselves are not kept)."""

    samples: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    task_seconds: float = 0.0
    windows: int = 0
    # local updates: what lockstep (synchronous) steps would have made this replica wait
    # for the slowest one, from the steps' measured times (max over replicas - its own)
    lockstep_wait_s: float = 0.0
    # asynchronous updates: how many of its pushes the store applied at each staleness
    # (index τ), the store's waits included in its step times
    staleness_counts: list[int] = field(default_factory=list)

    def add(self, samples: int, stage_seconds: Mapping[str, float], task_seconds: float) -> None:
        self.samples += samples
        for name, value in stage_seconds.items():
            self.stage_seconds[name] += value
        self.task_seconds += task_seconds
        self.windows += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "stage_seconds": dict(self.stage_seconds),
            "task_seconds": self.task_seconds,
            "windows": self.windows,
            "lockstep_wait_s": self.lockstep_wait_s,
            "staleness_counts": list(self.staleness_counts),
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> ReplicaTotals:
        totals = cls(
            samples=int(state["samples"]),
            task_seconds=float(state["task_seconds"]),
            windows=int(state["windows"]),
            lockstep_wait_s=float(state.get("lockstep_wait_s", 0.0)),  # older checkpoints
            staleness_counts=[int(n) for n in state.get("staleness_counts", ())],
        )
        for name, value in state["stage_seconds"].items():
            totals.stage_seconds[name] += float(value)
        return totals


@dataclass
class PhaseProgress:
    """The driver's state inside a phase at a committed step.

    ``steps``: the phase's steps as planned (the epochs it must complete);
    ``segment``: the steps running now (after a lost worker, the rest re-split);
    ``norm_pairs``: the gradient-norm pairs of the committed steps (the noise scale is
    updated from them when the phase ends); ``epoch_loss``: the running (sum, samples)
    of the epoch in progress; ``totals``: per replica, its work so far; ``seconds``:
    the phase's wall time so far; ``lost``: the replicas lost earlier in the phase, each
    with its work up to its loss (so the phase's per-replica counts still add up).
    """

    phase: PhaseSpec
    steps: tuple[StepSpec, ...]
    segment: tuple[StepSpec, ...]
    lr_factor: float = 1.0
    rollbacks: int = 0
    norm_pairs: list[tuple] = field(default_factory=list)
    epoch_loss: tuple[float, int] = (0.0, 0)
    totals: list[ReplicaTotals] = field(default_factory=list)
    seconds: float = 0.0  # the phase's wall time so far (on the driver's clock)
    # replicas lost earlier in the phase: (worker, its work up to its loss)
    lost: list[tuple[str, ReplicaTotals]] = field(default_factory=list)

    def carried_to(self, replicas: int, step: int) -> tuple[list | None, tuple]:
        """The per-replica totals a run of the phase on ``replicas`` goes on from, and
        the work of replicas no longer in it: on the same count, the totals as saved;
        on another (a restart, a resume elsewhere), none, the saved replicas' work kept
        with the lost ones' ("replica r before step s"), so the counts still add up."""
        earlier = tuple(self.lost)
        if len(self.totals) == replicas:
            return self.totals, earlier
        saved = tuple(
            (f"replica {rank} before step {step}", totals)
            for rank, totals in enumerate(self.totals)
            if totals.samples or totals.windows
        )
        return None, earlier + saved

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": phase_to_dict(self.phase),
            "steps": steps_to_list(self.steps),
            "segment": steps_to_list(self.segment),
            "lr_factor": float(self.lr_factor),
            "rollbacks": int(self.rollbacks),
            "norm_pairs": [tuple(pair) for pair in self.norm_pairs],
            "epoch_loss": (float(self.epoch_loss[0]), int(self.epoch_loss[1])),
            "totals": [t.to_dict() for t in self.totals],
            "seconds": float(self.seconds),
            "lost": [[worker, t.to_dict()] for worker, t in self.lost],
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> PhaseProgress:
        loss_sum, loss_samples = state["epoch_loss"]
        return cls(
            phase=phase_from_dict(state["phase"]),
            steps=steps_from_list(state["steps"]),
            segment=steps_from_list(state["segment"]),
            lr_factor=float(state["lr_factor"]),
            rollbacks=int(state["rollbacks"]),
            norm_pairs=[tuple(pair) for pair in state["norm_pairs"]],
            epoch_loss=(float(loss_sum), int(loss_samples)),
            totals=[ReplicaTotals.from_dict(t) for t in state["totals"]],
            seconds=float(state.get("seconds", 0.0)),  # older checkpoints: not recorded
            lost=[(str(w), ReplicaTotals.from_dict(t)) for w, t in state.get("lost", ())],
        )
