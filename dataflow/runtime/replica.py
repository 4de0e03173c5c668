"""One replica on its worker, and the Dask task functions that drive it.

Inside a window task the stages run as a local pipeline, step after step: no Dask
round trip between steps. Each task function looks its replica up in the worker
plugin by run id; only small results (losses, timings) go back to the driver.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from dataflow.core.errors import NonFiniteError
from dataflow.core.step import micro_batch_sizes
from dataflow.core.window import PEER_WAIT, THROTTLE, WindowResult
from dataflow.runtime.collective import Collective
from dataflow.runtime.device_memory import MemoryProbe, largest_micro_batch
from dataflow.runtime.host_copies import HostArena
from dataflow.runtime.leases import WindowLeases, planned_tasks
from dataflow.runtime.replica_spec import ReplicaSpec, ReplicaState, resolve_device
from dataflow.runtime.replica_state import StateSide
from dataflow.runtime.replica_store import StoreSide
from dataflow.runtime.window_parts import (
    WindowTally,
    add_note,
    host_pairs,
    micro_batch_groups,
)
from dataflow.stages.base import Batch, Gradients, PhaseContext, ReplicaContext, StepContext
from dataflow.stages.held_out_checks import non_finite_inputs

__all__ = ["ReplicaRuntime", "ReplicaSpec", "ReplicaState", "resolve_device"]


class ReplicaRuntime(StateSide, StoreSide):
    """A replica's stages and context; runs windows of steps."""

    def __init__(
        self,
        spec: ReplicaSpec,
        *,
        rank: int,
        world_size: int,
        collective: Collective | None,
        spatial: Any = None,
        device_rank: int | None = None,
    ):
        self.spec = spec
        # This worker's place among the fit's workers (its rank without a spatial layout);
        # the driver sets it again at each regroup and rollback.
        self.slot = rank if device_rank is None else device_rank
        # A simulated slow node (tests, benchmarks, demos): each step sleeps
        # (factor - 1) x its compute, i.e. the stages that do not wait on data or peers;
        # the factor may move over the fit's wall time (dataflow.runtime.throttle).
        self.slowdown = spec.throttle.get(rank)
        self.waiting = {n for n in spec.order if spec.graph[n].waits_on_peers_or_data}
        self.order = spec.order
        self.stages = {name: spec.graph[name] for name in spec.order}
        self.inputs = {name: spec.graph.inputs_of(name) for name in spec.order}
        self.context = ReplicaContext(
            rank=rank,
            world_size=world_size,
            device=resolve_device(spec.device, rank if device_rank is None else device_rank),
            seed=spec.seed,
            collective=collective,
            spatial=spatial,
            local=spec.local,
            asynchronous=spec.asynchronous,
            requested_step_options=spec.requested_step_options,
            planned_bucket_mb=spec.bucket_mb,
        )
        self.groups = micro_batch_groups(self.order, self.stages)
        # sync_batchnorm: every replica runs a step's micro-batches paired, empty ones too
        self.paired = any(stage.pairs_micro_batches for stage in self.stages.values())
        self.steps: dict[int, Any] = {}
        # In-memory commits: the state at the start of the last windows, by first step.
        # After a lost worker the driver rolls every survivor back to the last step all
        # replicas finished, which is the start of a window this replica began.
        self.commits: dict[int, dict[str, Any]] = {}
        # The host buffers each commit's copies went into, and dropped commits' buffers,
        # reused by the next commits (page-locked on a GPU: see runtime.host_copies)
        self.commit_arenas: dict[int, HostArena] = {}
        self.spare_arenas: list[HostArena] = []
        self.completed_step: int | None = None  # the step after the last finished window
        self.in_window = False  # a window started and did not finish: the state is partial
        # Held while a window runs: a survivor's rollback waits for its aborted window.
        self.lock = threading.Lock()
        # Replaced process groups, kept alive (destroying one with a pending operation
        # blocks the worker; see Collective.abort); the plugin keeps them past the fit.
        self.retired: list[Collective] = []
        self.generation = 0  # the driver's process-group generation this replica is in
        self.rollbacks = 0  # in this generation, counted alike on every replica (leases)
        # (generation, step): the driver released a lost replica; windows from ``step`` on
        # are not run (the survivors finish the window in flight, then regroup)
        self.released_after: tuple[int, int] | None = None
        self.held: int | None = None  # a stop: the generation that starts no more windows
        self.measure_memory = False  # on CUDA: the phase's first window measures its memory
        for name in self.order:
            self.stages[name].setup(self.context)

    def begin_phase(self, phase: PhaseContext) -> None:
        self.steps = {spec.index: spec for spec in phase.steps}
        self.measure_memory = self.context.device.type == "cuda" and not phase.continued
        for name in self.order:
            self.stages[name].begin_phase(self.context, phase)

    def run_window(
        self, first_step: int, stop_step: int, checkpoint: bool = False, *, weights: bool = False
    ) -> WindowResult:
        with self.lock:
            probe = MemoryProbe(self.context.device) if self.measure_memory else None
            self.measure_memory = False
            result = self._run_window(first_step, stop_step)
            if probe is not None:
                held = largest_micro_batch(self.steps, first_step, stop_step, self.context.rank)
                result.memory = probe.finish(held)
            if checkpoint:
                result.checkpoint = self.checkpoint_state()
            elif weights:
                result.checkpoint = self.weights_state()
            return result

    def _run_window(self, first_step: int, stop_step: int) -> WindowResult:
        started = time.perf_counter()
        if self.spec.commit_windows:
            self.commit(first_step)
        self.in_window = True
        self.context.window = (first_step, stop_step)
        store = self.context.parameter_store
        if store is None:
            return self._run_steps(first_step, stop_step, started)
        try:
            store.begin_window(first_step)
            return self._run_steps(first_step, stop_step, started)
        except BaseException as exc:  # the others must not wait for this replica's pushes
            store.abort(f"replica {self.context.rank} failed in window {first_step}: {exc!r}")
            raise

    def _run_steps(self, first_step: int, stop_step: int, started: float) -> WindowResult:
        stage_seconds = dict.fromkeys(self.order, 0.0)
        tally = WindowTally(first_step, stop_step)
        for index, part in self._tasks(first_step, stop_step):
            self._train(index, part, tally, stage_seconds)
        store, staleness = self.context.parameter_store, []
        if store is not None and self.spec.asynchronous is not None:
            # wait for all; take the store's state
            self._settle_with_store(store, tally, stage_seconds, stop_step)
            staleness = list(store.applied)  # every push of this replica's, as applied
        elif store is not None:  # local updates: their average (a stage's end_window)
            self.context.window_parts = tuple(self._planned_parts(first_step, stop_step))
            self.context.retrain = lambda parts: self._retrain(parts, tally, stage_seconds)
        measured: dict[str, float] = {}
        for name in self.order:  # checks made once per window (before any state leaves)
            measured.update(self.stages[name].end_window(self.context) or {})
        evals: dict[int, dict[str, float]] = {}
        for ended in tally.epoch_ends:  # (local updates evaluate the average there)
            if "eval" in ended.metrics:
                evals[ended.spec.index] = ended.metrics["eval"]
        self.in_window, self.completed_step = False, stop_step
        return WindowResult(
            rank=self.context.rank,
            first_step=first_step,
            samples=tally.samples,
            losses=tally.step_losses(),
            step_seconds=tally.seconds,
            stage_seconds=stage_seconds,
            task_seconds=time.perf_counter() - started,
            evals=evals,
            samples_read=tally.read,
            sample_digest=tally.digest,
            norm_pairs=host_pairs(tally.pairs, tally.skipped),
            staleness=staleness,
            store_wait_s=tally.waits if staleness else [],
            taken_over=tally.taken,
            retrained=tally.retrained,
            skipped=tally.skipped,
            drift=measured.get("drift"),
            lrs=tally.lrs,
            grad_norms=tally.step_grad_norms(),
        )

    def _train(self, index: int, part: int | None, tally: WindowTally, stage_seconds: dict) -> None:
        """One task: this replica's part of step ``index`` (``part`` None), or replica
        ``part``'s part of it (taken over, or trained again after its replica was lost)."""
        step_start = time.perf_counter()
        step = StepContext(replica=self.context, spec=self.steps[index], part=part)
        for name in self.order:
            self.stages[name].begin_step(step)
        values: dict[str, Any] = {}
        micro_batches = step.spec.micro_batches_of(step.owner)
        step_compute = 0.0
        for group in self.groups:
            if micro_batches > 1 and self.stages[group[0]].per_micro_batch:
                step_compute += self._run_micro_batches(step, group, values, stage_seconds)
            else:
                for name in group:
                    step_compute += self._run_stage(step, name, values, stage_seconds)
        factor = 1.0 if self.slowdown is None else self.slowdown.factor_at(self._fit_seconds())
        if factor > 1.0:  # a slow node, simulated: counted as compute
            pause = (factor - 1.0) * step_compute
            time.sleep(pause)
            stage_seconds[THROTTLE] = stage_seconds.get(THROTTLE, 0.0) + pause
        tally.add(step, time.perf_counter() - step_start)

    def _fit_seconds(self) -> float:
        """Seconds since the fit began, the clock of a moving slow-down."""
        return time.time() - self.spec.started_at

    def _tasks(self, first_step: int, stop_step: int) -> Any:
        """(step, part) in the order this replica trains them: its own parts of every
        step, or, under sample leases, parts handed out on demand (runtime/leases.py)."""
        policy = self.spec.local or self.spec.asynchronous
        collective = self.context.collective
        if not getattr(policy, "leases", False) or collective is None:
            return planned_tasks(first_step, stop_step)
        key = f"dataflow-leases/{self.spec.run_id}/g{self.generation}/r{self.rollbacks}"
        return WindowLeases(
            collective.store,
            f"{key}/w{first_step}",
            first=first_step,
            stop=stop_step,
            replicas=self.context.world_size,
            rank=self.context.rank,
        ).tasks()

    def _run_stage(
        self, step: StepContext, name: str, values: dict[str, Any], stage_seconds: dict
    ) -> float:
        """Run one stage on its parents' values; returns its compute seconds (0 if waiting)."""
        args = [values[parent] for parent in self.inputs[name]]
        waited = step.replica.peer_wait_s
        t = time.perf_counter()
        try:
            values[name] = self.stages[name].run(step, *args)
        except Exception as exc:
            note = f"in stage {name!r} on replica {step.replica.rank}, step {step.spec.index}"
            if step.micro_count > 1:
                note += f", micro-batch {step.micro_index + 1} of {step.micro_count}"
            add_note(exc, note)
            # Peers waiting on this replica in a collective fail now. A NaN caught before
            # the update is no such case: every replica saw the same reduced gradient and
            # stops at the same step, so the group stays usable for the rollback.
            if not isinstance(exc, NonFiniteError):
                self.abort()
            else:  # name the samples whose data is not finite, where the step holds them
                found = non_finite_inputs([v for v in values.values() if isinstance(v, Batch)])
                if found is not None and exc.args:  # (in the message: the driver prefers it)
                    exc.args = (f"{exc.args[0]}. Found: {found}", *exc.args[1:])
            raise
        elapsed = time.perf_counter() - t
        if (waited := step.replica.peer_wait_s - waited) > 0.0:  # on peers, inside the stage
            elapsed -= waited
            stage_seconds[PEER_WAIT] = stage_seconds.get(PEER_WAIT, 0.0) + waited
        stage_seconds[name] += elapsed
        return 0.0 if name in self.waiting else elapsed

    def _run_micro_batches(
        self, step: StepContext, group: tuple[str, ...], values: dict[str, Any], stage_seconds: dict
    ) -> float:
        """Gradient accumulation: run ``group`` (Forward, Backward...) once per micro-batch.

        Batches flowing into the group are sliced into ``micro_batches`` near-equal
        parts; Forward scales each part's loss by its share, so the accumulated
        gradient is the mean over the whole local batch, as without accumulation.
        The group's outputs are the last micro-batch's, with Gradients' sample
        counts summed.
        """
        count = step.spec.micro_batches_of(step.replica.rank)
        members = set(group)
        outside = {p for name in group for p in self.inputs[name] if p not in members}
        size = next((values[p].size for p in outside if isinstance(values[p], Batch)), None)
        paired = self.paired and self.context.world_size > 1
        if size is None or count <= 1 or (size <= 1 and not paired):
            return sum(self._run_stage(step, name, values, stage_seconds) for name in group)
        parts = micro_batch_sizes(size, count, paired=paired)
        whole = {p: values[p] for p in outside}
        compute, samples, start = 0.0, 0, 0
        step.micro_count = len(parts)
        try:
            for k, part in enumerate(parts):
                step.micro_index, step.micro_size = k, part
                for p, value in whole.items():
                    is_batch = isinstance(value, Batch)
                    values[p] = value.slice(start, start + part) if is_batch else value
                for name in self.order:
                    self.stages[name].begin_micro_batch(step)
                for name in group:
                    compute += self._run_stage(step, name, values, stage_seconds)
                last = values[group[-1]]
                if isinstance(last, Gradients):
                    samples += last.samples
                start += part
        finally:
            values.update(whole)
            step.micro_index, step.micro_count, step.micro_size = 0, 1, None
        if isinstance(values[group[-1]], Gradients):
            values[group[-1]] = dataclasses.replace(values[group[-1]], samples=samples)
        return compute

    def end_phase(self) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        for name in self.order:
            stats.update(self.stages[name].end_phase(self.context))
        stats["weights_digest"] = self.weights_digest()  # after stages synced their state
        if self.context.optimizer is not None:
            stats["lr"] = self.context.optimizer.param_groups[0].get("lr")
        return stats

    def regroup(self, collective: Collective | None, world_size: int) -> None:
        """Swap in the new process group; stages rebuild what depends on it (AllReduce
        re-broadcasts rank 0's weights and rebuilds its buckets) in graph order."""
        old = self.context.collective
        self.context.collective = collective
        self.context.world_size = world_size
        for name in self.order:
            self.stages[name].regroup(self.context)
        if old is not None:
            old.abort()
            self.retired.append(old)

    def abort(self) -> None:
        """Leave the fit's process group and, under a spatial layout, the sample group
        (a worker also waits there); fail the parameter store's waiting calls; end a
        stage's wait for data (``Stage.interrupt``)."""
        if self.context.collective is not None:
            self.context.collective.abort()
        if self.context.spatial is not None:
            self.context.spatial.abort()
        if self.context.parameter_store is not None:  # fail the store's waiting calls
            self.context.parameter_store.abort("the fit's driver aborted the window")
        for name in self.order:  # a stage waiting on data (Load) leaves its wait
            try:
                self.stages[name].interrupt("the fit's driver aborted the window")
            except Exception:  # best effort, as the rest of an abort
                pass

    def close(self) -> None:
        if self.context.parameter_store is not None:
            self.context.parameter_store.close()
        for name in reversed(self.order):
            try:
                self.stages[name].teardown(self.context)
            except Exception:  # teardown is best effort: the fit already ended
                pass
