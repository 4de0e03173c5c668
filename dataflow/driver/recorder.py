"""The fit's records: committed windows into steps and epochs, phases with their
per-replica speeds and time split, failures, checkpoints; the sample ledger and
the gradient noise scale fed from committed steps only.

The one writer of :class:`~dataflow.history.History`; the report reads it.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections import defaultdict
from operator import attrgetter, methodcaller
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from dataflow.checkpoint.progress import ReplicaTotals
from dataflow.core import kinds
from dataflow.core.errors import DataError, LossError
from dataflow.core.window import WHOLE, compute_seconds, scored_samples
from dataflow.driver.clock import RunClock, train_seconds
from dataflow.driver.salvage import salvage_leased, salvaged_result
from dataflow.driver.sample_check import SampleCheck
from dataflow.driver.step_times import lockstep_wait, plausible_step_seconds, steady_step_seconds
from dataflow.driver.step_values import mean_losses, step_grad_norms, step_lrs
from dataflow.history.records import (
    CheckpointRecord,
    EpochRecord,
    FailureRecord,
    PhaseRecord,
    StepRecord,
)
from dataflow.history.result import History, skipped_steps
from dataflow.io.ledger import SampleLedger
from dataflow.schedule.noise_scale import NoiseScaleTracker, NormPair

# a WindowResult's fields, read for every replica of a window in C (map), not bytecode
_CHECKPOINT = attrgetter("checkpoint")
_SAMPLES = attrgetter("samples")
_STALENESS = attrgetter("staleness")
_DRIFT = attrgetter("drift")
_TASK_SECONDS = attrgetter("task_seconds")
_STAGE_SECONDS = attrgetter("stage_seconds")
_LOSSES = attrgetter("losses")
_STEP_SECONDS = attrgetter("step_seconds")
_SKIPPED = attrgetter("skipped")
_NORM_PAIRS = attrgetter("norm_pairs")


class Recorder:
    """History, ledger and noise scale of one fit; ``graph``/``order``: the step's
    stages (their kinds split each replica's time), ``load``: the Load stage (a lost
    replica's samples follow from its streams)."""

    def __init__(
        self,
        *,
        graph: Any,
        order: tuple[str, ...],
        load: Any,
        seed: int,
        skips_non_finite: bool,
        progress: bool,
        cost_model: Any = None,
        lockstep_wait: bool = False,
        leases: bool = False,
        held_out_samples: int | None = None,
    ) -> None:
        self.graph, self.order, self.load, self.seed = graph, order, load, seed
        self.skips_non_finite, self.progress = skips_non_finite, progress
        # a CostModel with the fit's window and bucket sizes: each phase's prediction
        self.cost_model = cost_model
        self.lockstep_wait = lockstep_wait  # record the wait lockstep steps would have had
        # Sample leases: parts move between replicas within a window, so a lost
        # replica's result may hold parts the survivors' results do not mention.
        self.leases = leases
        self.held_out_samples = held_out_samples  # what an evaluation scores, if any
        self.history = History()
        self.ledger = SampleLedger(load.source.num_samples)
        self.noise = NoiseScaleTracker()
        self.reset_counts()
        self.clock = RunClock()  # the fit's training seconds, over its runs
        self.bar: Any = None
        self.sample_check = SampleCheck(load, seed)

    def reset_counts(self) -> None:
        self.samples_seen = 0
        self.epoch_loss_sum, self.epoch_samples = 0.0, 0
        self.phase_pairs: list[tuple] = []  # the committed steps' gradient-norm pairs
        self.totals = []  # per replica, its work in the phase
        self.lost_replicas: list[tuple[str, ReplicaTotals]] = []  # lost in the phase
        self.phase_started = time.perf_counter()
        self.phase_windows: list[tuple[float, int]] = []  # (commit time, steps) this phase
        self.phase_drift: list[float] = []  # local updates: the drift at each average

    # -- a phase ----------------------------------------------------------------------
    def begin_phase(
        self,
        phase: Any,
        steps: tuple,
        todo: tuple,
        *,
        carried=None,
        elapsed: float = 0.0,
        lost: tuple = (),
    ) -> None:
        """A new phase (or a resumed one, ``carried``: its totals so far, ``elapsed``: the
        seconds it ran before, ``lost``: its replicas lost before, with their totals)."""
        self.phase_pairs, self.phase_started = [], time.perf_counter() - elapsed
        self.phase_windows = []
        self.phase_drift = []
        self.totals = list(carried or [])
        self.lost_replicas = list(lost)
        self.close_bar()
        self.bar = tqdm(
            total=len(steps),
            initial=todo[0].index - steps[0].index if todo else 0,
            desc=f"phase {phase.index} (B={phase.global_batch})",
            unit="step",
            disable=not self.progress,
            dynamic_ncols=True,
        )

    def regrouped(self, kept: list[int], joined: int, workers: tuple[str, ...] = ()) -> None:
        """The replicas after a recovery: ``kept`` old ranks in their new order, then
        ``joined`` new ones with nothing done yet. The others were lost: their work up to
        the loss stays in the phase's record (``workers``: the old ranks' workers)."""
        totals = self.totals
        for rank, replica in enumerate(totals):
            if rank not in kept and (replica.samples or replica.windows):
                worker = workers[rank] if rank < len(workers) else f"replica {rank}"
                self.lost_replicas.append((worker, replica))
        self.totals = [totals[r] for r in kept if r < len(totals)]
        self.phase_windows = []  # the steady step time is the new group's
        self.totals = self.totals + [ReplicaTotals() for _ in range(joined)]

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # -- windows ----------------------------------------------------------------------
    def commit_window(
        self, plan: Any, window: Any, results: tuple, segment: tuple
    ) -> LossError | DataError | None:
        """Record a committed window; a None result is a replica lost after it finished
        the window (its partners could not have without it): its samples from the plan,
        its losses unknown (the step's loss is the others' mean). Vectorised over the
        replicas: a round of 1,024 costs the driver a few milliseconds. Returns why the
        window cannot be recorded (a loss not finite where nothing is skipped, samples
        other than the plan's), for the machine to decide on; None when recorded."""
        try:
            self._commit_window(plan, window, results, segment)
        except (LossError, DataError) as refused:
            return refused
        return None

    def _commit_window(self, plan: Any, window: Any, results: tuple, segment: tuple) -> None:
        specs = plan.steps[window.first : window.stop]
        lost = list(map(operator.is_, results, itertools.repeat(None)))  # not ==: no __eq__ each
        salvaged = [rank for rank, gone in enumerate(lost) if gone] if any(lost) else []
        filled = list(results)
        for rank in salvaged:
            filled[rank] = salvaged_result(specs, rank)
        if salvaged and self.leases:
            salvage_leased(filled, salvaged, specs)
        # Passes over the replicas by map and attrgetter (no Python frame per replica: a
        # round of 1,024 replicas is a few of them)
        checkpoints = list(map(_CHECKPOINT, filled))
        if checkpoints.count(None) != len(checkpoints):
            for w in filled:  # the history keeps the window's numbers, not its weights
                w.checkpoint = None
        samples = np.array(list(map(_SAMPLES, filled)), dtype=np.int64)  # replicas x steps
        self._add_totals(filled, samples.sum(axis=1))
        if self.lockstep_wait and not salvaged:
            store_waits = None
            if all(len(w.store_wait_s) == len(w.step_seconds) for w in filled):
                store_waits = [w.store_wait_s for w in filled]
            self._wait[: len(filled)] += lockstep_wait(
                [w.step_seconds for w in filled], store_waits
            )
        staleness = list(map(_STALENESS, filled))
        if any(staleness):  # asynchronous updates only
            for rank, taus in enumerate(staleness):
                for tau in taus:
                    counts = self._staleness.setdefault(rank, [])
                    counts.extend([0] * (tau + 1 - len(counts)))
                    counts[tau] += 1
        self._record_steps(specs, plan.phase.index, filled, samples, salvaged)
        moved = self.leases and bool(salvaged)  # the lost may have taken parts over
        self.sample_check.record(self.ledger, segment, specs, filled, salvaged, moved)
        self.phase_windows.append((time.perf_counter(), len(specs)))
        drifts = list(map(_DRIFT, filled))  # alike on all
        if drifts.count(None) != len(drifts):
            self.phase_drift.append(next(d for d in drifts if d is not None))

    def _add_totals(self, window: list[Any], samples: np.ndarray) -> None:
        replicas = len(window)
        if len(self._samples) < replicas:  # joiners: nothing done yet
            grow = replicas - len(self._samples)
            self._samples = np.concatenate([self._samples, np.zeros(grow, np.int64)])
            self._task = np.concatenate([self._task, np.zeros(grow)])
            self._windows = np.concatenate([self._windows, np.zeros(grow, np.int64)])
            self._wait = np.concatenate([self._wait, np.zeros(grow)])
            for name in self._stage:
                self._stage[name] = np.concatenate([self._stage[name], np.zeros(grow)])
        self._samples[:replicas] += samples
        self._task[:replicas] += list(map(_TASK_SECONDS, window))
        self._windows[:replicas] += 1
        stages = list(map(_STAGE_SECONDS, window))
        names = {name for seconds in (stages[0], stages[-1]) for name in seconds}
        if set(map(len, stages)) != {len(names)}:  # salvaged, or unusual
            names = set().union(*stages)
        for name in names:
            column = self._stage.get(name)
            if column is None:
                column = self._stage[name] = np.zeros(len(self._samples))
            column[:replicas] += list(map(methodcaller("get", name, 0.0), stages))

    @property
    def totals(self) -> list[ReplicaTotals]:
        """Each replica's work in the phase so far (what the phase record, the balancer
        and a mid-phase checkpoint need)."""
        out = []
        for r in range(len(self._samples)):
            totals = ReplicaTotals(
                samples=int(self._samples[r]),
                task_seconds=float(self._task[r]),
                windows=int(self._windows[r]),
                lockstep_wait_s=float(self._wait[r]),
                staleness_counts=list(self._staleness.get(r, ())),
            )
            for name, column in self._stage.items():
                totals.stage_seconds[name] += float(column[r])
            out.append(totals)
        return out

    @totals.setter
    def totals(self, totals: list[ReplicaTotals]) -> None:
        self._samples = np.array([t.samples for t in totals], dtype=np.int64)
        self._task = np.array([t.task_seconds for t in totals], dtype=float)
        self._windows = np.array([t.windows for t in totals], dtype=np.int64)
        self._wait = np.array([t.lockstep_wait_s for t in totals], dtype=float)
        self._staleness = {
            r: list(t.staleness_counts) for r, t in enumerate(totals) if t.staleness_counts
        }
        names = {name for t in totals for name in t.stage_seconds}
        self._stage = {
            name: np.array([t.stage_seconds.get(name, 0.0) for t in totals], dtype=float)
            for name in names
        }

    def _record_steps(
        self, specs: tuple, phase: int, window: list[Any], samples: np.ndarray, salvaged: list
    ) -> None:
        seconds = np.array(list(map(_STEP_SECONDS, window)), dtype=float).max(axis=0)
        known = samples > 0
        known[salvaged] = False  # a lost replica's losses are unknown: the others' mean
        step_losses = mean_losses(list(map(_LOSSES, window)), samples, known)
        step_totals = samples.sum(axis=0)
        skipped = set().union(*map(_SKIPPED, window))  # on_non_finite="skip"
        lrs = step_lrs(window, len(specs))
        grad_norms = step_grad_norms(window, samples, known)
        now = self.clock.now()  # since training began, earlier runs included
        for i, spec in enumerate(specs):
            loss, total = float(step_losses[i]), int(step_totals[i])
            dropped = spec.index in skipped  # its update was dropped (skip, fp16 overflow)
            if not math.isfinite(loss) and not (self.skips_non_finite or dropped):
                raise LossError(
                    f"the loss is {loss} at step {spec.index} (epoch {spec.epoch}); training "
                    "diverged: lower the learning rate or check the inputs for NaN/inf"
                )
            self.history.steps.append(
                StepRecord(
                    step=spec.index,
                    phase=phase,
                    epoch=spec.epoch,
                    loss=loss,
                    samples=total,
                    seconds=float(seconds[i]),
                    time=now,
                    skipped=spec.index in skipped or None,
                    lr=lrs[i],
                    grad_norm=grad_norms[i],
                )
            )
            self.samples_seen += total
            if math.isfinite(loss):  # a dropped non-finite step does not poison the mean
                self.epoch_loss_sum += loss * total
                self.epoch_samples += total
            if spec.last_in_epoch:
                self._record_epoch(spec, window)
        self.phase_pairs.extend(itertools.chain.from_iterable(map(_NORM_PAIRS, window)))
        if self.bar is not None:
            last = self.history.steps[-1]
            self.bar.update(len(specs))
            self.bar.set_postfix(
                epoch=last["epoch"],
                loss=f"{last['loss']:.4g}",
                samples_s=f"{self.samples_seen / max(now, 1e-9):.0f}",
                refresh=False,
            )

    def _record_epoch(self, spec: Any, window: list[Any]) -> None:
        train_loss = self.epoch_loss_sum / max(self.epoch_samples, 1)
        self.epoch_loss_sum, self.epoch_samples = 0.0, 0
        metrics: dict[str, float] = {}
        evals = [w.evals[spec.index] for w in window if spec.index in w.evals]
        count = None  # the held-out samples the evaluation scored
        if evals:
            count = scored_samples(evals)
            if any(e.get(WHOLE) for e in evals):  # each holds the whole set's sums
                evals = [next(e for e in evals if e.get(WHOLE))]
            for key in evals[0]:
                if key not in ("count", WHOLE):
                    metrics[f"eval_{key}"] = sum(e[key] for e in evals) / max(count, 1)
        total = self.held_out_samples
        if count is not None and total is not None and count < total:  # never silently
            self.history.info.setdefault("partial_evaluations", []).append(
                {"epoch": spec.epoch, "scored": count, "held_out": total}
            )
        self.history.epochs.append(EpochRecord(spec.epoch, train_loss, metrics, count))

    # -- phase end --------------------------------------------------------------------
    def end_phase(self, phase: Any, phase_steps: tuple, segment: tuple, ends: tuple) -> None:
        """Check the phase's epochs, feed the noise scale, record the phase."""
        self.close_bar()
        self._check_epochs_complete(phase_steps)
        self._track_noise(self.phase_pairs)
        seconds = time.perf_counter() - self.phase_started
        rates, data_wait = [], []
        loads = {n for n in self.order if self.graph[n].kind == kinds.LOAD}
        totals = self.totals
        waiting = {n for n in self.order if self.graph[n].waits_on_peers_or_data}
        for replica in totals:
            stages = replica.stage_seconds
            compute = compute_seconds(stages, waiting)
            rates.append(replica.samples / compute if compute > 0 else 0.0)
            total = sum(stages.values())
            data_wait.append(sum(stages.get(n, 0.0) for n in loads) / total if total > 0 else 0.0)
        first = segment[0]
        measured, measured_note = self._measured_step_seconds(phase)
        self.history.phases.append(
            PhaseRecord(
                phase=phase.index,
                start_epoch=phase.start_epoch,
                end_epoch=phase.end_epoch,
                global_batch=phase.global_batch,
                lr=ends[0].get("lr", phase.lr),
                local_batches=list(first.local_batches),
                micro_batches=list(first.micro_batches or [1] * len(first.local_batches)),
                replicas=len(first.local_batches),
                noise_scale=phase.noise_scale,
                gain=phase.gain,
                measured_noise_scale=self.noise.noise_scale,
                progress_start=phase.progress_start,
                progress_end=phase.progress_end,
                samples_per_second=rates,
                steps=len(phase_steps),
                windows=totals[0].windows,
                seconds=seconds,
                task_seconds=[t.task_seconds for t in totals],
                stage_seconds=[dict(t.stage_seconds) for t in totals],
                data_wait_fraction=data_wait,
                chunks_decoded=[end.get("chunks_decoded", 0) for end in ends],
                peak_buffered_samples=[end.get("peak_buffered_samples", 0) for end in ends],
                store_retries=[end.get("store_retries", 0) for end in ends],
                skipped_steps=len(skipped_steps(self.history.steps, phase.index)),
                measured_step_seconds=measured,
                measured_step_note=measured_note,
                lockstep_wait_s=(
                    [t.lockstep_wait_s for t in totals] if self.lockstep_wait else None
                ),
                samples_trained=[t.samples for t in totals]
                + [t.samples for _, t in self.lost_replicas],
                lost_replicas=[
                    {"worker": worker, "samples": t.samples, "windows": t.windows}
                    for worker, t in self.lost_replicas
                ]
                or None,
                compile_seconds=_per_replica(ends, "compile_seconds"),
                compiled_shapes=_per_replica(ends, "compiled_shapes"),
                capture_seconds=_per_replica(ends, "capture_seconds"),
                captured_shapes=_per_replica(ends, "captured_shapes"),
                captured_steps=_per_replica(ends, "captured_steps"),
                capture_failures=sorted({f for e in ends for f in e.get("capture_failures", ())})
                or None,
                overflow_steps=ends[0].get("overflow_steps"),
                loss_scale=ends[0].get("loss_scale"),
                drift=list(self.phase_drift) or None,
                staleness_counts=(
                    [t.staleness_counts for t in totals]
                    if any(t.staleness_counts for t in totals)
                    else None
                ),
                predicted=self._predicted(phase, first),
            )
        )

    def _measured_step_seconds(self, phase: Any) -> tuple[float | None, str | None]:
        steps = self.history.steps
        seconds = [s["seconds"] for s in steps if s["phase"] == phase.index]
        median = float(np.median(seconds)) if seconds else None
        steady = steady_step_seconds(self.phase_windows, step_median=median)
        return plausible_step_seconds(steady, seconds)

    def _predicted(self, phase: Any, first: Any) -> dict[str, Any] | None:
        """The cost model's step at this phase's replicas, batch and split."""
        model = self.cost_model
        if model is None:
            return None
        local = list(first.local_batches)
        micro = list(first.micro_batches or [1] * len(local))
        if model.max_micro_batch is None and max(micro) > 1:  # per-replica caps: as run
            caps = [math.ceil(b / m) for b, m in zip(local, micro, strict=True)]
            model = model.replace(max_micro_batch=max(caps))
        split = local if sum(local) == phase.global_batch else None
        breakdown = model.breakdown(
            replicas=len(local), global_batch=phase.global_batch, local_batches=split
        )
        return breakdown.to_dict()

    def measured_speeds(self) -> list[list[float]]:
        """Per past phase, each replica's samples/s (the balancer's input)."""
        return [p["samples_per_second"] for p in self.history.phases]

    def _track_noise(self, pairs: list[tuple]) -> None:
        """Feed the committed steps' gradient-norm pairs to the tracker in step order."""
        by_step: dict[int, list[NormPair]] = defaultdict(list)
        for index, small, small_sq, big, big_sq in pairs:
            by_step[index].append(NormPair(small, small_sq, big, big_sq))
        for index in sorted(by_step):
            self.noise.update(by_step[index])

    def _check_epochs_complete(self, steps: tuple) -> None:
        """Each epoch of the phase trained on exactly the samples the plan gave it (the
        ledger, filled window by window, refused any repeat already)."""
        planned: dict[int, int] = defaultdict(int)
        for spec in steps:
            planned[spec.epoch] += spec.global_batch
        for epoch, count in planned.items():
            consumed = len(self.ledger.consumed(epoch))
            if consumed != count:
                raise DataError(
                    f"epoch {epoch}: the replicas trained on {consumed} distinct samples but the "
                    f"plan gave them {count}; the loader lost or repeated data: please report "
                    "this with the plan (Pipeline.plan())"
                )

    # -- failures and checkpoints -------------------------------------------------------
    def failure(self, record: FailureRecord, open_entry: Any = None) -> FailureRecord:
        """A new entry of ``history.info["failures"]`` (a copy of ``record``: the
        command's stays as the machine decided it), or ``open_entry`` updated."""
        if open_entry is None:
            open_entry = record.copy()
            open_entry.detected_at = time.time()
            self.history.info.setdefault("failures", []).append(open_entry)
            return open_entry
        open_entry.update(record)
        return open_entry

    def checkpoint_written(
        self, path: Any, phase: int, step: int, mid_phase: bool, seconds: float
    ) -> None:
        self.history.info.setdefault("checkpoints", []).append(
            CheckpointRecord(
                path=str(path), phase=phase, step=step, mid_phase=mid_phase, seconds=seconds
            )
        )

    def record_segments(self, end_step: int | None = None) -> None:
        """``info["segments"]``: each run of the fit, this one up to ``end_step`` (default:
        after its last step); ``info["train_seconds"]``: their seconds together."""
        info, steps = self.history.info, self.history.steps
        if end_step is None:
            end_step = steps[-1]["step"] + 1 if steps else self.clock.start_step
        info["segments"] = self.clock.segments(end_step, self.samples_seen, info.get("run_id"))
        info["train_seconds"] = train_seconds(info["segments"])


def _per_replica(ends: list[dict[str, Any]], key: str) -> list[Any] | None:
    """Each replica's ``key`` from its end-of-phase statistics; None when none has it."""
    values = [end.get(key) for end in ends]
    return values if any(v is not None for v in values) else None
