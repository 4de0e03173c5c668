"""The stage base class (the values that flow between stages live in ``dataflow.core``).

A stage is a small object with a typed config, built on the driver, pickled once
to every replica's worker, and driven there by the replica runtime:
``setup`` once per fit, ``begin_phase``/``end_phase`` around each phase,
``begin_step`` then ``run`` once per training step (in graph order).
Runtime state (the model, hooks, threads) lives on the :class:`ReplicaContext`
or in private attributes set in ``setup``; it never travels back to the driver.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dataflow.core import kinds
from dataflow.core.batch import Batch, ForwardOutput, Gradients
from dataflow.core.step import PhaseContext, ReplicaContext, StepContext, StepSpec

# The values are defined in the bottom layer (io and the runtime use them too); they are
# re-exported here, where stage authors have always imported them from.
__all__ = [
    "Batch",
    "ForwardOutput",
    "Gradients",
    "PhaseContext",
    "ReplicaContext",
    "Stage",
    "StepContext",
    "StepSpec",
]


class Stage:
    """Base class of every stage. Subclasses override what they need.

    ``name`` is unique within a graph (the graph suffixes duplicates). A user stage
    subclasses this and implements :meth:`run`; see ``examples/custom_graph.py``.
    """

    #: What this stage's time counts as (:mod:`dataflow.core.kinds`): "compute", or
    #: "load" / "allreduce" (waiting on data or peers), or "evaluate".
    kind: ClassVar[str] = kinds.COMPUTE

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__

    @property
    def waits_on_peers_or_data(self) -> bool:
        """True when this stage's time is waiting on data or peers, not compute (a
        simulated slow node slows only the rest)."""
        return self.kind in kinds.WAITING

    def setup(self, replica: ReplicaContext) -> None:
        """Once per fit on the worker, in graph order (Forward builds the model first)."""

    def regroup(self, replica: ReplicaContext) -> None:
        """Between phases, after the set of replicas changed (workers joined): the
        context has the new ``world_size`` and ``collective``. Stages that hold state
        tied to the process group rebuild it here."""

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None:
        """Before the first step of each phase."""

    def phase_state(self) -> dict[str, Any] | None:
        """Phase-level settings a replica joining mid-phase must share (after a lost
        worker: the LR ramp's start and target); plain values. None: nothing."""
        return None

    def load_phase_state(self, state: dict[str, Any]) -> None:
        """Take over :meth:`phase_state` of rank 0 (a replica joining mid-phase)."""

    def begin_step(self, step: StepContext) -> None:
        """Before any stage runs in this step (e.g. arm gradient hooks)."""

    #: Runs once per micro-batch when a replica accumulates gradients (Forward, Backward):
    #: the runtime slices the batch and runs each contiguous run of such stages per slice.
    per_micro_batch: bool = False
    #: Its forward reduces over the replicas (``sync_batchnorm``): every replica runs a
    #: step in as many micro-batches as the others, empty ones included, so the k-th
    #: micro-batches' reductions pair up.
    pairs_micro_batches: bool = False

    def begin_micro_batch(self, step: StepContext) -> None:
        """Before each micro-batch of a step that accumulates gradients (e.g. only the
        last micro-batch's backward may start the allreduce)."""

    def run(self, step: StepContext, *inputs: Any) -> Any:
        """Do this stage's work for one step; the return value feeds downstream stages."""
        return inputs[0] if inputs else None

    def end_window(self, replica: ReplicaContext) -> dict[str, float] | None:
        """After the last step of each window (a Dask task), before its result goes back:
        what is checked once per window rather than once per step (Update's deferred
        non-finite check on a GPU), and what a window's end measures (AllReduce under
        local updates: the replicas' drift, ``{"drift": ...}``, into the window's
        result). Raising here fails the window."""

    def interrupt(self, reason: str) -> None:
        """From another thread, when the driver aborts the running window (a peer failed,
        or its wait for this replica timed out): a stage blocked on something that is not
        a collective (Load waiting for its batch) leaves that wait by raising, so the
        window ends instead of outliving the abort. Best effort; never raises."""

    def end_phase(self, replica: ReplicaContext) -> dict[str, Any]:
        """After the last step of a phase; returns statistics for the driver."""
        return {}

    def teardown(self, replica: ReplicaContext) -> None:
        """When the fit ends or fails: release threads, hooks, buffers."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
