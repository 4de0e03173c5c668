"""What one replica reports back for a window of steps.

The worker builds it and the driver folds it into the history and the checkpoint;
it lives in the bottom layer so both sides share one definition without importing
each other.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

__all__ = ["PEER_WAIT", "THROTTLE", "WINDOWS_AHEAD", "WindowResult", "compute_seconds"]

# How many windows a replica may have queued past the driver's last commit, and so how
# many commits (the state at a window's start) it keeps: whatever results a lost worker
# takes with it, the driver's commit is one of them. The driver queues the windows of a
# plan no further ahead; a replica drops a commit only when this many newer ones exist.
WINDOWS_AHEAD = 2

# The ``stage_seconds`` key of the time a replica waited on its peers inside a compute
# stage (``sync_batchnorm``'s reductions in Forward and Backward): kept apart from the
# stage's own time, so a fast replica waiting for a slow one is not counted as slow.
PEER_WAIT = "peer_wait"
THROTTLE = "throttle"  # a simulated slow node's extra time (compute: runtime.throttle)


def compute_seconds(stage_seconds: dict[str, float], waiting: set[str] | frozenset[str]) -> float:
    """A replica's compute among its ``stage_seconds``: all but the ``waiting`` stages
    (those that wait on peers or data) and the waits on peers inside other stages."""
    return sum(v for name, v in stage_seconds.items() if name not in waiting and name != PEER_WAIT)


@dataclass
class WindowResult:
    """Per-step losses and timings of one window on one replica."""

    rank: int
    first_step: int
    samples: list[int]
    losses: list[float | None]
    step_seconds: list[float]
    stage_seconds: dict[str, float]
    task_seconds: float
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    # What Load read over the window: the count and the digest of the sample indices
    # (dataflow.core.digest); the driver knows the indices from the plan and checks.
    samples_read: int = 0
    sample_digest: int | None = None  # None: no Load stage reported
    # (step, small batch, |g_small|^2, big batch, |g_big|^2) per measured step: the
    # driver folds them into the noise-scale estimate once the window is committed.
    norm_pairs: list[tuple[int, int, float, int, float]] = field(default_factory=list)
    # The replica's state at the window's end, when the driver asked for a checkpoint
    # there (:meth:`dataflow.runtime.replica.ReplicaRuntime.checkpoint_state`).
    checkpoint: dict[str, Any] | None = None
    # Asynchronous updates: per step, the staleness the parameter store applied this
    # replica's push at, and the seconds the push and pull took (waits included).
    staleness: list[int] = field(default_factory=list)
    store_wait_s: list[float] = field(default_factory=list)
    # Sample leases: (step, part) of the parts of other replicas' batches this replica
    # took over; ``samples``, ``losses`` and the digest include them
    taken_over: list[tuple[int, int]] = field(default_factory=list)
    # A replica lost in the window (asynchronous updates): the parts of it this one
    # trained again at the window's end (also in ``taken_over``: the store had not
    # applied them)
    retrained: list[tuple[int, int]] = field(default_factory=list)
    # on_non_finite="skip": the steps whose update this replica dropped (its part of
    # them, under local or asynchronous updates), their state left as before the step
    skipped: list[int] = field(default_factory=list)
    # On CUDA, the first window of a phase: the peak memory it allocated above what the
    # replica held before it, the most samples one forward/backward held, and the
    # device memory the step could use (``dataflow.runtime.device_memory``)
    memory: dict[str, float] | None = None
    # Local updates: how far the replicas' weights had drifted apart when this window's
    # end averaged them, sum_r w_r |θ_r − θ̄|² / |θ̄|² (the same on every replica)
    drift: float | None = None
    # Per step of the window, the LR its update ran at (param group 0; None where the
    # replica trained no part of the step, or the LR is a tensor)
    lrs: list[float | None] = field(default_factory=list)
    # ``clip_grad_norm``: per step of the window, the norm of the gradient before
    # clipping (sample-weighted over the parts this replica trained; [] without clipping)
    grad_norms: list[float | None] = field(default_factory=list)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A result pickled before a field existed (in a driver log saved for a bug
        report, a checkpoint) loads with that field's default."""
        for f in fields(self):
            if f.name not in state and f.default_factory is not MISSING:
                state[f.name] = f.default_factory()
            elif f.name not in state and f.default is not MISSING:
                state[f.name] = f.default
        self.__dict__.update(state)


# In an evaluation's scores (``WindowResult.evals``): they were summed over every
# replica, so each replica's result holds the whole held-out set's, not its share's
WHOLE = "whole"


def scored_samples(evals: list[dict[str, float]]) -> int:
    """How many held-out samples the replicas' scores of one evaluation cover: one
    replica's count when they were summed over the group (``WHOLE``), else the sum."""
    whole = [e for e in evals if e.get(WHOLE)]
    return int(whole[0]["count"]) if whole else int(sum(e.get("count", 0) for e in evals))
