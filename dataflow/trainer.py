"""The driver: runs a graph phase by phase on a Dask cluster.

For each phase it asks the schedule for the global batch and LR, the balancer
for the split, builds the :class:`~dataflow.plan.Plan`, submits one task per
window per replica (pinned to the replica's worker, chained behind its previous
window), and folds the small per-window results into the history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client, wait
from tqdm.auto import tqdm

from dataflow.balance import Balancer, Even, micro_batch_counts
from dataflow.checkpoint import (
    Checkpoint,
    CheckpointStore,
    capture_rng,
    fingerprint,
    ledger_from_state,
    ledger_state,
    phase_from_dict,
    phase_to_dict,
    restore_rng,
)
from dataflow.errors import (
    BatchSizeError,
    CollectiveError,
    ConfigError,
    DataError,
    LossError,
    NonFiniteError,
    ReplicaError,
    WorkerLostError,
)
from dataflow.graph import Graph
from dataflow.history import FitResult, History
from dataflow.io.ledger import SampleLedger
from dataflow.noise_scale import NoiseScaleTracker, NormPair
from dataflow.plan import Plan, checkpoint_windows, phase_steps, resplit_steps
from dataflow.progress import PhaseProgress, ReplicaTotals
from dataflow.runtime import replica as remote
from dataflow.runtime.cluster import client_or_local_cluster, live_workers
from dataflow.schedule import PhaseMeasurement, PhaseSpec, Schedule
from dataflow.stages import Forward, Load, Update
from dataflow.stages.base import PhaseContext
from dataflow.stages.evaluate import bind_evaluations
from dataflow.stages.forward import build_model

CALIBRATION_STEPS = 2
FAILURE_GRACE_S = 5.0  # how long to wait for the other replicas' errors after the first
LIVENESS_POLL_S = 1.0  # how often the driver checks that the fit's workers are alive
NON_FINITE_LR_CUT = 0.5  # on_non_finite="rollback": the LR factor applied per rollback
MAX_ROLLBACKS = 3  # ... per phase; then the NonFiniteError stops the fit
RESTART_WAIT_S = 60.0  # every replica lost: how long to wait for min_workers to be back
RESTART_GATHER_S = 10.0  # ... then how long for as many as the fit had (restarts straggle)
MAX_RESTARTS = 3  # ... and how often to start again from one checkpoint (no progress)


class WorkersLost(Exception):
    """Internal: workers of the fit are gone; the driver recovers on the survivors."""

    def __init__(self, workers: list[str]) -> None:
        super().__init__(f"lost workers {workers}")
        self.workers = workers


class AllReplicasLost(Exception):
    """Internal: every replica died at once, so no survivor holds the commit; the driver
    starts again from the newest checkpoint on the workers the cluster has then."""

    def __init__(self, lost: WorkersLost, phase: int | None) -> None:
        super().__init__(f"every replica lost: {lost.workers}")
        self.lost, self.phase = lost, phase


@dataclass(kw_only=True)
class TrainerConfig:
    """How a fit runs (what it computes is the graph and the schedule)."""

    seed: int = 0
    replicas: int | None = None  # default: every worker of the client
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when the worker has one)
    threads_per_replica: int | None = None  # torch intra-op threads; default: the worker's
    window_seconds: float = 1.0  # work fused into one Dask task
    # A collective that waits longer fails (a peer died or hangs); the driver also
    # watches the workers, so a lost worker is usually noticed within a second or two.
    collective_timeout_s: float = 30.0
    # Keep training when workers die: survivors roll back to the last window every
    # replica finished and go on; below min_workers the fit stops with WorkerLostError.
    recover_lost_workers: bool = True
    min_workers: int = 1
    relax_malloc: bool = True  # undo Dask's MALLOC_TRIM_THRESHOLD_ in replica workers
    freeze_gc: bool = True  # gc.freeze() the workers' long-lived objects after setup
    pause_dask_profiler: bool = True  # no 10 ms stack sampling of replica workers while fitting
    balancer: Balancer = field(default_factory=Even)
    # Memory cap: the most samples one replica's forward/backward holds; a larger local
    # batch is run as micro-batches with gradient accumulation. One int, or one per replica.
    max_micro_batch: int | tuple[int, ...] | None = None
    throttle: dict[int, float] = field(default_factory=dict)  # rank -> simulated slow-down
    # With replicas=None, workers that joined the client are used from the next phase.
    elastic: bool = True
    # Ask the cluster for more workers (up to max_workers) when a phase's batch per
    # replica would exceed max_micro_batch; LocalCluster, dask-jobqueue, any cluster.scale.
    scale_with_batch: bool = False
    max_workers: int | None = None
    scale_timeout_s: float = 120.0  # how long to wait for requested workers to arrive
    progress: bool = True
    dry_run: bool = True  # one tiny step on the driver first, for early clear errors

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ConfigError(f"replicas must be an int >= 1 or None, got {self.replicas!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ConfigError(f"threads_per_replica must be >= 1, got {self.threads_per_replica}")
        for name in ("window_seconds", "collective_timeout_s", "scale_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.threads_per_replica is not None and (
            isinstance(self.threads_per_replica, bool)
            or not isinstance(self.threads_per_replica, int)
        ):
            raise ConfigError(
                f"threads_per_replica must be an int >= 1 or None, got {self.threads_per_replica!r}"
            )
        if not self.window_seconds > 0:
            raise ConfigError(
                f"window_seconds must be > 0 (seconds of work per Dask task), got "
                f"{self.window_seconds}"
            )
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if (
            isinstance(self.min_workers, bool)
            or not isinstance(self.min_workers, int)
            or self.min_workers < 1
        ):
            raise ConfigError(
                f"min_workers must be an int >= 1 (the fewest workers a fit goes on with "
                f"after losing some), got {self.min_workers!r}"
            )
        if not isinstance(self.throttle, dict) or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 0 or not float(f) >= 1.0
            for r, f in self.throttle.items()
        ):
            raise ConfigError(
                f"throttle={self.throttle!r}: give {{rank: factor}} with factors >= 1, e.g. "
                "{1: 2.0} to make replica 1 take twice its compute time (a simulated slow node)"
            )
        caps = (
            self.max_micro_batch
            if isinstance(self.max_micro_batch, tuple | list)
            else [self.max_micro_batch]
        )
        if self.max_micro_batch is not None and any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in caps
        ):
            raise ConfigError(
                f"max_micro_batch={self.max_micro_batch!r}: give the most samples one replica "
                "can hold in a forward/backward (an int >= 1, or a tuple with one per replica), "
                "or None for no cap"
            )
        if self.max_workers is not None and (
            isinstance(self.max_workers, bool)
            or not isinstance(self.max_workers, int)
            or self.max_workers < 1
        ):
            raise ConfigError(f"max_workers must be an int >= 1 or None, got {self.max_workers!r}")
        if self.scale_with_batch and (
            not isinstance(self.max_micro_batch, int) or self.max_workers is None
        ):
            raise ConfigError(
                "scale_with_batch=True needs max_micro_batch (an int: the samples one replica "
                "can hold) and max_workers (the most workers to ask the cluster for), e.g. "
                "max_micro_batch=64, max_workers=8"
            )
        if self.scale_with_batch and self.replicas is not None:
            raise ConfigError(
                f"scale_with_batch=True with replicas={self.replicas}: a fixed replica count "
                "cannot grow; leave replicas=None"
            )
        if not self.scale_timeout_s > 0:
            raise ConfigError(f"scale_timeout_s must be > 0, got {self.scale_timeout_s}")
        if isinstance(self.balancer, str | bytes) or not isinstance(self.balancer, Balancer):
            raise ConfigError(
                f"balancer must be a dataflow.balance balancer such as "
                f"dataflow.balance.Throughput() or Even(), got {type(self.balancer).__name__} "
                f"{self.balancer!r}"
            )


class Trainer:
    """Runs ``graph`` under ``schedule``; see :class:`dataflow.Pipeline` for the usual graph."""

    def __init__(self, graph: Graph, *, schedule: Schedule, **config: Any) -> None:
        if not isinstance(graph, Graph):
            raise ConfigError(f"Trainer(graph=...) expects a dataflow.Graph, got {type(graph)}")
        if isinstance(schedule, type):
            raise ConfigError(
                f"schedule={schedule.__name__} is a class; pass an instance, e.g. "
                f"{schedule.__name__}(...) such as Fixed(64)"
            )
        if not isinstance(schedule, Schedule):
            raise ConfigError(
                f"schedule must be a dataflow.schedule schedule such as Fixed(64), got "
                f"{type(schedule).__name__}"
            )
        self.graph = graph
        self.schedule = schedule
        bind_evaluations(graph)  # Evaluate applies the graph's deterministic transforms
        _check_options(config)
        self.config = TrainerConfig(**config)
        loads = [s for s in graph if isinstance(s, Load)]
        if not loads:
            raise ConfigError("the graph has no Load stage: add g.add(stages.Load(source))")
        self.load = loads[0]
        self.source = loads[0].source
        self.drop_last = loads[0].config.drop_last
        forwards = [s for s in graph if isinstance(s, Forward)]
        self.model_factory = forwards[0].config.model if forwards else None
        self.measures_noise = bool(getattr(schedule, "measures_noise", False))
        # on_non_finite: with "skip" a NaN step loss is a dropped step, not a failure; with
        # "rollback" the driver goes back to the last commit with half the LR.
        policies = {s.config.on_non_finite for s in graph if isinstance(s, Update)}
        self.skips_non_finite = "skip" in policies
        self.rolls_back_non_finite = "rollback" in policies

    def next_phase(
        self,
        start_epoch: int,
        total_epochs: int,
        previous: PhaseSpec | None,
        measured: PhaseMeasurement | None = None,
    ) -> PhaseSpec:
        """Ask the schedule for the next phase; only schedules that measure the gradient
        noise (``measures_noise``) are given the measurement."""
        extra: dict[str, Any] = {"measured": measured} if self.measures_noise else {}
        if getattr(self.schedule, "needs_epoch_size", False):  # phases of N steps
            extra.update(num_samples=self.source.num_samples, drop_last=self.drop_last)
        return self.schedule.next_phase(
            start_epoch=start_epoch, total_epochs=total_epochs, previous=previous, **extra
        )

    # -- inspection, no cluster ---------------------------------------------------------
    def plan(
        self, epochs: int, replicas: int | Sequence[int], *, step_seconds: float | None = None
    ) -> list[Plan]:
        """The plans a fit of ``epochs`` on ``replicas`` would run (first phase's view).

        ``replicas`` may list the replica count of each phase (the last one repeats), as
        in a fit where workers joined between phases (``history.phases[i]["replicas"]``).
        """
        _check_epochs(epochs)
        counts = [replicas] if isinstance(replicas, int) else list(replicas)
        plans, epoch, previous, index = [], 0, None, 0
        while epoch < epochs:
            world = counts[min(len(plans), len(counts) - 1)]
            order = self.graph.validate(replicas=world)
            phase = self.next_phase(epoch, epochs, previous)
            steps = self._phase_steps(phase, world, index)
            plans.append(
                Plan.build(
                    order,
                    phase,
                    steps,
                    world,
                    step_seconds=step_seconds,
                    window_seconds=self.config.window_seconds,
                )
            )
            epoch, previous, index = phase.end_epoch, phase, index + len(steps)
        return plans

    def sample_plan(self, epochs: int, replicas: int | Sequence[int]) -> list[list[np.ndarray]]:
        """Per global step, each replica's sample indices, exactly as ``fit`` reads them.

        Concatenated over replicas they are the step's global batch: a single
        process training on them reproduces the fit (the equivalence tests do).
        """
        steps = [spec for plan in self.plan(epochs, replicas) for spec in plan.steps]
        return [parts for _, parts in self.load.streams(steps, self.config.seed)]

    def _phase_steps(
        self, phase: PhaseSpec, replicas: int, first_index: int, measured: Any = ()
    ) -> tuple:
        """The phase's steps, split by the balancer from the speeds ``measured`` so far."""

        def split(size: int) -> tuple[int, ...]:
            return self.config.balancer.split(size, replicas, measured)

        return phase_steps(
            num_samples=self.source.num_samples,
            phase=phase,
            split=split,
            drop_last=self.drop_last,
            first_index=first_index,
            micro_batches=self._micro_batches(replicas),
        )

    def _micro_batches(self, replicas: int, after_loss: bool = False) -> Any:
        """Each replica's micro-batches for a split: above the memory cap, accumulate; one
        replica estimates the gradient noise from two micro-batches of each step."""
        minimum = 2 if replicas == 1 and self.measures_noise else 1

        def micro_batches(local: tuple[int, ...]) -> tuple[int, ...]:
            caps = self.config.max_micro_batch
            if after_loss and isinstance(caps, tuple) and len(caps) != len(local):
                caps = min(caps)  # after a lost worker: the tightest cap for every replica
            return micro_batch_counts(local, caps, minimum=minimum)

        return micro_batches

    # -- fitting --------------------------------------------------------------------
    def fit(
        self,
        epochs: int,
        client: Client | None = None,
        *,
        checkpoint_dir: str | Path | None = None,
        resume: bool = False,
        keep_checkpoints: int = 3,
        checkpoint_every: int | None = None,
    ) -> FitResult:
        """Train for ``epochs``. With ``checkpoint_dir``, a checkpoint is written
        atomically at every phase boundary, and inside a phase every
        ``checkpoint_every`` windows (a window is about ``window_seconds`` of work);
        ``resume=True`` continues from the newest valid one there (refused, with the
        differences listed, if it belongs to another model, dataset, seed or schedule).
        With the same replica count the resumed fit ends bit-identical to an
        uninterrupted one, from a phase boundary or from inside a phase."""
        _check_epochs(epochs)
        _check_checkpoint_every(checkpoint_every, checkpoint_dir)
        store, checkpoint = self._open_checkpoints(checkpoint_dir, resume, keep_checkpoints, epochs)
        if self.schedule.max_batch() > self.source.num_samples:
            raise BatchSizeError(
                f"schedule asks for a global batch of {self.schedule.max_batch()} but the "
                f"dataset has {self.source.num_samples} samples; use a batch size <= "
                f"{self.source.num_samples}"
            )
        self.graph.validate(replicas=self.config.replicas or 1)
        if self.config.dry_run:
            self._dry_run()
        with client_or_local_cluster(client, announce=self.config.progress) as active:
            return _Fit(
                self,
                active,
                epochs,
                store=store,
                checkpoint=checkpoint,
                checkpoint_every=checkpoint_every,
            ).run()

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must share with this fit to resume it (see dataflow.checkpoint)."""
        model = build_model(self.model_factory, self.config.seed)
        config = {"seed": self.config.seed, "schedule": self.schedule, "drop_last": self.drop_last}
        return fingerprint(model, self.source, config)

    def _open_checkpoints(
        self, directory: Any, resume: bool, keep: int, epochs: int
    ) -> tuple[CheckpointStore | None, Checkpoint | None]:
        if directory is None:
            if resume:
                raise ConfigError(
                    "fit(resume=True) needs checkpoint_dir=... (the folder the interrupted "
                    "fit wrote its checkpoints to)"
                )
            return None, None
        store = CheckpointStore(directory, keep=keep)  # an unwritable folder fails here
        self.checkpoint_fingerprint = self.fingerprint()  # once per fit: it builds a model
        if not resume:  # a new run: an old run's later steps must not count as the latest
            store.clear()
        checkpoint = store.load_latest(self.checkpoint_fingerprint) if resume else None
        if checkpoint is not None and checkpoint.epoch >= epochs:
            raise ConfigError(
                f"fit(epochs={epochs}, resume=True): the checkpoint in {directory} is already "
                f"at epoch {checkpoint.epoch}; ask for more epochs to continue training"
            )
        return store, checkpoint

    def _dry_run(self) -> None:
        """One step of two samples through the whole graph on the driver, no cluster.

        A factory that returns no module, a loss that is not a scalar, a transform
        that fails: each surfaces here, before any worker starts, with a plain traceback.
        Stages are shallow-copied, so what their setup stores never reaches the workers.
        """
        graph = self.graph.shallow_copy()
        order = graph.validate(replicas=1)
        size = min(2, self.source.num_samples)
        phase = PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=size)
        steps = phase_steps(num_samples=self.source.num_samples, phase=phase, split=lambda n: (n,))
        step = dataclasses.replace(steps[0], last_in_epoch=False)  # no end-of-epoch evaluation
        spec = remote.ReplicaSpec(run_id="dry-run", graph=graph, order=order, seed=self.config.seed)
        runtime = remote.ReplicaRuntime(spec, rank=0, world_size=1, collective=None)
        try:
            runtime.begin_phase(PhaseContext(index=0, steps=(step,), lr=None))
            runtime.run_window(step.index, step.index + 1)
        finally:
            runtime.close()


def _check_options(options: dict[str, Any]) -> None:
    """Unknown options are named, with the closest valid one (a typo is the usual cause)."""
    valid = [f.name for f in dataclasses.fields(TrainerConfig)]
    for name, value in options.items():
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown option {name}={value!r}{hint} Valid options: {', '.join(valid)}"
            )


def _check_checkpoint_every(every: Any, directory: Any) -> None:
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"fit(checkpoint_every={every!r}): give the number of windows between checkpoints "
            "inside a phase (an int >= 1; a window is about window_seconds of work), or None "
            "for checkpoints at phase boundaries only"
        )
    if directory is None:
        raise ConfigError(
            f"fit(checkpoint_every={every}) needs checkpoint_dir=... (the folder to write the "
            "checkpoints to)"
        )


def _check_epochs(epochs: Any) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"fit(epochs={epochs!r}): epochs must be an int >= 1")


class _Fit:
    """The state of one fit on the driver."""

    def __init__(
        self,
        trainer: Trainer,
        client: Client,
        epochs: int,
        *,
        store: CheckpointStore | None = None,
        checkpoint: Checkpoint | None = None,
        checkpoint_every: int | None = None,
    ) -> None:
        self.trainer = trainer
        self.checkpoint_every = checkpoint_every
        self.config = trainer.config
        self.client = client
        self.epochs = epochs
        self.run_id = f"fit{uuid.uuid4().hex[:12]}"
        self.store, self.resumed = store, checkpoint
        self.history = History()
        self.ledger = SampleLedger(trainer.load.source.num_samples)
        self.noise = NoiseScaleTracker()  # the gradient noise scale, smoothed over steps
        self.samples_seen = 0  # running totals: the history is not rescanned per window
        self.epoch_loss_sum, self.epoch_samples = 0.0, 0
        self.phase_pairs: list[tuple] = []  # the committed steps' gradient-norm pairs
        # Where the phases start: epoch 0, or where the resumed checkpoint ended; inside
        # a phase (a mid-phase checkpoint), the phase and how far it got.
        self.start: tuple[int, PhaseSpec | None, int, PhaseMeasurement | None] = (0, None, 0, None)
        self.resume_in_phase: PhaseProgress | None = None
        if checkpoint is not None:
            self._restore_driver(checkpoint)

    def _restore_driver(self, checkpoint: Checkpoint) -> None:
        state = checkpoint.schedule_state
        measurement = state.get("measurement")
        self.start = (
            checkpoint.epoch,
            phase_from_dict(state.get("previous")),
            checkpoint.step,
            None if measurement is None else PhaseMeasurement(**measurement),
        )
        if checkpoint.mid_phase:
            progress = PhaseProgress.from_dict(checkpoint.in_phase)
            self.resume_in_phase, self.resume_step = progress, checkpoint.step
            self.start = (progress.phase.start_epoch, None, progress.steps[0].index, None)
            self.epoch_loss_sum, self.epoch_samples = progress.epoch_loss
        if state.get("noise") is not None:
            self.noise.load_state_dict(state["noise"])
        if checkpoint.ledger is not None:
            self.ledger = ledger_from_state(checkpoint.ledger)
        saved = History(**checkpoint.history)
        self.history.steps, self.history.epochs = saved.steps, saved.epochs
        self.history.phases = saved.phases
        self.samples_seen = sum(s["samples"] for s in saved.steps)
        restore_rng(checkpoint.rng)

    def _restore_replicas(self, checkpoint: Checkpoint) -> None:
        """Every replica takes the checkpoint's weights, optimizer state and stage
        settings, and, with as many replicas as were saved, its own saved random state
        and buffers (otherwise the random state of its rank if saved, and rank 0's
        buffers, which are in the weights)."""
        state = {
            "model": checkpoint.model_state,
            "optimizer": checkpoint.optimizer_state,
            "stages": checkpoint.stage_state,
        }
        # To one worker: the others fetch it when their task needs it. (A broadcast waits
        # on every worker, and on one that just died, for the scheduler's retries.)
        [state] = self.client.scatter([state], workers=self.workers[:1], hash=False)
        rngs, buffers = checkpoint.replica_rng, checkpoint.replica_buffers
        same_world = len(buffers) == len(self.workers)
        self._gather(
            [
                self._submit(
                    remote.restore_replica,
                    r,
                    state,
                    rngs[r] if r < len(rngs) else None,
                    buffers[r] if same_world else None,
                    key=f"restore@replica{r}-{self.run_id}{self._generation_tag()}",
                )
                for r in range(len(self.workers))
            ]
        )

    def _save_checkpoint(
        self, phase: PhaseSpec, next_step: int, measurement: PhaseMeasurement
    ) -> None:
        """At a phase boundary: rank 0's synchronized weights and optimizer state, every
        replica's random state, and the driver's schedule, balancer, ledger and history."""
        states = self._replica_states(f"p{phase.index}{self._generation_tag()}")
        schedule_state = {
            "previous": phase_to_dict(phase),
            "measurement": dataclasses.asdict(measurement),
        }
        self._write_checkpoint(states, phase, phase.end_epoch, next_step, schedule_state)

    def _replica_states(self, tag: str) -> list[dict[str, Any]]:
        """Every replica's part of a checkpoint, after its last task (rank 0's first)."""
        return self._gather(
            [
                self._submit(
                    remote.replica_checkpoint_state,
                    r,
                    self.last_futures[r],
                    key=f"checkpoint@replica{r}-{self.run_id}-{tag}",
                )
                for r in range(len(self.workers))
            ]
        )

    def _save_mid_phase(self, phase: PhaseSpec, states: list[dict[str, Any]]) -> Path:
        """Inside a phase, at the committed step: what :meth:`_save_checkpoint` saves, and
        where the phase stands (:class:`PhaseProgress`) so a resume goes on from there."""
        step = self.committed_step
        epoch = next(spec.epoch for spec in self.phase_steps if spec.index == step)
        progress = PhaseProgress(
            phase=phase,
            steps=self.phase_steps,
            segment=self.segment,
            lr_factor=self.lr_factor,
            rollbacks=self.rollbacks,
            norm_pairs=list(self.phase_pairs),
            epoch_loss=(self.epoch_loss_sum, self.epoch_samples),
            totals=self._phase_totals(self.phase_results),
        )
        return self._write_checkpoint(states, phase, epoch, step, {}, progress)

    def _write_checkpoint(
        self,
        states: list[dict[str, Any]],
        phase: PhaseSpec,
        epoch: int,
        step: int,
        schedule_state: dict[str, Any],
        progress: PhaseProgress | None = None,
    ) -> Path:
        """``states``: each replica's :func:`remote.replica_checkpoint_state`, rank 0's
        with the weights. Writes atomically; the history lists what was written."""
        started = time.perf_counter()
        leader = states[0]
        path = self.store.save(
            Checkpoint(
                model_state=leader["model"],
                optimizer_state=leader["optimizer"] or {},
                stage_state={k: v for k, v in leader["stages"].items() if v is not None},
                phase_index=phase.index,
                epoch=epoch,
                step=step,
                schedule_state={**schedule_state, "noise": self.noise.state_dict()},
                ledger=ledger_state(self.ledger),
                rng=capture_rng(),
                replica_rng=[s["rng"] for s in states],
                replica_buffers=[s["buffers"] for s in states],
                history=_json_plain(self.history.to_dict()),
                fingerprint=self.trainer.checkpoint_fingerprint,
                in_phase=None if progress is None else progress.to_dict(),
            )
        )
        self.history.info.setdefault("checkpoints", []).append(
            {
                "path": str(path),
                "phase": phase.index,
                "step": step,
                "mid_phase": progress is not None,
                "seconds": time.perf_counter() - started,
            }
        )
        return path

    def _workers(self) -> list[str]:
        if str(getattr(self.client, "status", "running")) in ("closing", "closed"):
            raise ConfigError(
                "the client is closed; pass an open distributed.Client, or client=None for "
                "an embedded LocalCluster"
            )
        workers = live_workers(self.client)
        addresses = sorted(workers, key=lambda a: (workers[a].get("host", ""), a))
        wanted = self.config.replicas or len(addresses)
        if wanted > len(addresses):
            raise ConfigError(
                f"replicas={wanted} but the client has {len(addresses)} worker(s); start more "
                "workers or lower replicas"
            )
        if not addresses:
            raise ConfigError("the client has no workers; start some before fit()")
        return addresses[:wanted]

    def run(self) -> FitResult:
        client = self.client
        self.workers = workers = self._workers()
        world = len(workers)
        order = self.trainer.graph.validate(replicas=world)
        self.order = order
        spec = remote.ReplicaSpec(
            run_id=self.run_id,
            graph=self.trainer.graph,
            order=order,
            seed=self.config.seed,
            device=self.config.device,
            threads=self.config.threads_per_replica,
            collective_timeout_s=self.config.collective_timeout_s,
            relax_malloc=self.config.relax_malloc,
            freeze_gc=self.config.freeze_gc,
            pause_dask_profiler=self.config.pause_dask_profiler,
            throttle={int(r): float(f) for r, f in self.config.throttle.items()},
            commit_windows=self.config.recover_lost_workers,
        )
        started = time.perf_counter()
        try:
            self.spec = spec
            self._scatter_spec(workers)
            self.generation = 0
            infos = self._start_replicas()
            world = len(self.workers)
            self.history.info = {
                "run_id": self.run_id,
                "epochs": self.epochs,
                "replicas": world,
                "seed": self.config.seed,
                "stages": list(order),
                "stage_kinds": {name: type(self.trainer.graph[name]).__name__ for name in order},
                "workers": infos,
                "dashboard": client.dashboard_link,
                "regroups": [],
            }
            self.last_futures: list[Any] = [None] * world
            # (future, worker) of the phase: what a lost worker's recovery must stop
            self.in_flight: list[tuple[Any, str]] = []
            self.window_stops: dict[int, int] = {}  # window first step -> stop step
            self.committed_step = self.start[2]  # the first step not yet committed
            self.last_phase: PhaseSpec | None = None
            if self.resumed is not None:
                self._restore_replicas(self.resumed)
                self.history.info["resumed_from"] = {
                    "epoch": self.resumed.epoch,
                    "step": self.resumed.step,
                    "phase": self.resumed.phase_index,
                }
            self.train_started = time.perf_counter()
            self._train()
            self.history.info["train_seconds"] = time.perf_counter() - self.train_started
            state = self._surviving(self.last_phase, self._final_weights)
        except BaseException:
            _quietly(lambda: client.run(remote.abort_run, self.run_id, workers=self.workers))
            raise
        finally:
            self.in_flight = []  # release the fit's futures (and their results) now
            _quietly(lambda: client.run(remote.close_run, self.run_id, workers=self.workers))
        self.history.info["fit_seconds"] = time.perf_counter() - started
        model = build_model(self.trainer.model_factory, self.config.seed)
        model.load_state_dict(state)
        result = FitResult(model=model, history=self.history, ledger=self.ledger)
        if self.config.progress:
            print(result.summary())
        return result

    def _train(self) -> None:
        """Run the phases. If every replica dies at once (no survivor holds the last
        commit), start again from the newest checkpoint on the workers there are then
        (a nanny's restarts, a scheduler's replacements)."""
        restarts: dict[int, int] = defaultdict(int)  # per checkpoint step started from
        while True:
            try:
                return self._run_phases()
            except AllReplicasLost as every:
                while True:
                    checkpoint = self._restart_point(len(every.lost.workers))
                    if checkpoint is None or restarts[checkpoint.step] >= MAX_RESTARTS:
                        error = self._too_few_error(every.lost, every.phase, saved=None)
                        if checkpoint is not None:
                            error.args = (
                                f"{error} (the fit started again from the checkpoint of step "
                                f"{checkpoint.step} {MAX_RESTARTS} times and lost every "
                                "replica each time before the next checkpoint)",
                            )
                        self.workers = []  # what the fit's clean-up talks to: none is left
                        raise error from None
                    restarts[checkpoint.step] += 1
                    try:
                        self._restart_from(checkpoint, every)
                        break
                    except (WorkerLostError, WorkersLost):  # lost again while starting
                        continue

    def _restart_point(self, had: int) -> Checkpoint | None:
        """The newest valid checkpoint, once ``min_workers`` workers are there (and, for
        a few more seconds, up to the ``had`` the fit ran on: a nanny's restarts arrive
        one by one); None if there is no checkpoint folder, no checkpoint yet, or no
        workers come back."""
        if self.store is None or self.store.latest() is None:
            return None
        try:
            self.client.wait_for_workers(self.config.min_workers, timeout=RESTART_WAIT_S)
        except TimeoutError:
            return None
        wanted = min(had, self.config.replicas or had)
        with contextlib.suppress(TimeoutError):
            self.client.wait_for_workers(wanted, timeout=RESTART_GATHER_S)
        return self.store.load_latest(self.trainer.checkpoint_fingerprint)

    def _restart_from(self, checkpoint: Checkpoint, every: AllReplicasLost) -> None:
        """The driver's state back to ``checkpoint`` (history, ledger, noise, position);
        new replicas on the workers the client has now, loaded from it."""
        record = {
            "phase": every.phase,
            "reason": "every replica lost",
            "lost": list(every.lost.workers),
            "detected_at": time.time(),
            "commit_step": self.committed_step,
            "restarted_from_step": checkpoint.step,
            # what runs again: from the checkpoint to the end of the window in progress
            "window_steps_lost": self.window_stops.get(self.committed_step, self.committed_step)
            - checkpoint.step,
        }
        self.history.info.setdefault("failures", []).append(record)
        if self.config.progress:
            print(
                f"dataflow: every replica was lost; starting again from the checkpoint of "
                f"step {checkpoint.step}"
            )
        self.ledger = SampleLedger(self.trainer.load.source.num_samples)
        self.noise = NoiseScaleTracker()
        self.epoch_loss_sum, self.epoch_samples = 0.0, 0
        self.resume_in_phase = None
        self._restore_driver(checkpoint)
        self.workers = self._available_workers()[: self.config.replicas or None]
        self.generation += 1
        self.in_flight = []
        self._scatter_spec(self.workers[:1])  # the others fetch it (see _restore_replicas)
        self.history.info["workers"] += self._start_replicas()
        self.last_futures = [None] * len(self.workers)
        self.history.info["replicas"] = len(self.workers)
        self._restore_replicas(checkpoint)
        self.committed_step = self.start[2]
        record.update(resumed_at=time.time(), replicas_after=len(self.workers))

    def _scatter_spec(self, workers: list[str]) -> None:
        """Send the replica spec (graph, sources) once to ``workers``."""
        try:
            [self.spec_future] = self.client.scatter(
                [self.spec], broadcast=True, workers=workers, hash=False
            )
        except Exception:
            self._raise_if_lost()  # a worker died meanwhile: recover, send again
            raise

    def _start_replicas(self) -> list[dict[str, Any]]:
        """Build every replica; a worker lost meanwhile is left out (a new group)."""
        while True:
            world = len(self.workers)
            try:
                host, port = self._rendezvous(world, self.generation)
                setups = self._setup_replicas(
                    list(enumerate(self.workers)), world, host, port, self.generation, None
                )
                return self._gather(setups)
            except WorkersLost as lost:
                alive = [a for a in self.workers if a not in lost.workers]
                if len(alive) < self.config.min_workers or not alive:
                    self.workers = alive
                    raise WorkerLostError(
                        f"lost worker(s) {', '.join(lost.workers)} while starting the fit; "
                        f"{len(alive)} remain (min_workers={self.config.min_workers})"
                    ) from None
                _quietly(lambda a=alive: self.client.run(remote.close_run, self.run_id, workers=a))
                self.workers = alive
                self.generation += 1
                self._scatter_spec(alive[:1])

    def _final_weights(self) -> dict[str, Any]:
        [state] = self._gather(
            [
                self._submit(
                    remote.replica_state_dict,
                    0,
                    key=f"weights@replica0-{self.run_id}{self._generation_tag()}",
                )
            ]
        )
        return state

    def _rendezvous(self, world: int, generation: int) -> tuple[Any, Any]:
        """Rank 0's worker opens the store the group ``generation`` forms at."""
        if world == 1:
            return None, None
        [address] = self._gather(
            [
                self.client.submit(
                    remote.open_rendezvous,
                    self.run_id,
                    world,
                    self.config.collective_timeout_s,
                    generation,
                    workers=[self.workers[0]],
                    allow_other_workers=False,
                    pure=False,
                    key=f"rendezvous-{self.run_id}-g{generation}",
                )
            ]
        )
        return address

    def _setup_replicas(
        self,
        ranks: list[tuple[int, str]],
        world: int,
        host: Any,
        port: Any,
        generation: int,
        snapshot: Any,
        spec: Any = None,
    ) -> list[Any]:
        """``spec``: the ReplicaSpec itself for workers joining a running fit (the copies
        scattered at the start may have died with their workers); by default the
        scattered one."""
        return [
            self.client.submit(
                remote.setup_replica,
                self.spec_future if spec is None else spec,
                rank,
                world,
                host,
                port,
                generation,
                snapshot,
                workers=[address],
                allow_other_workers=False,
                pure=False,
                key=f"setup@replica{rank}-{self.run_id}-g{generation}",
            )
            for rank, address in ranks
        ]

    def _grow(self, phase: PhaseSpec) -> None:
        """At a phase boundary: ask for workers if the batch outgrew the memory cap, then
        bring every worker that joined the client into the fit (new process group, rank 0's
        weights and optimizer state). Replicas keep their ranks; new ones come after."""
        if self.config.scale_with_batch and self.config.elastic:
            self._request_workers(phase)
        joined = self._joinable()
        if not joined:
            return
        joined = self._form_group(joined, phase)
        if self.config.progress:
            print(
                f"dataflow: {len(joined)} worker(s) joined; phase {phase.index} runs "
                f"{len(self.workers)} replicas"
            )

    def _joinable(self) -> list[str]:
        """Workers of the client not in the fit that it may take, in order."""
        config = self.config
        if not config.elastic or isinstance(config.max_micro_batch, tuple):
            return []  # per-replica caps: a fixed set of replicas
        # A fixed replica count is a target: workers replace lost ones up to it.
        limit = config.replicas if config.replicas is not None else config.max_workers
        joined = [a for a in self._available_workers() if a not in self.workers]
        if limit is not None:
            joined = joined[: max(0, limit - len(self.workers))]
        return joined

    def _form_group(self, joined: list[str], phase: PhaseSpec | None) -> list[str]:
        """A new process group over the fit's replicas and ``joined`` (new ranks after
        theirs): the replicas keep their state, the newcomers get rank 0's weights
        (broadcast) and optimizer state (snapshot). Returns the workers that joined;
        a loss meanwhile leaves the joiners out and raises :class:`WorkersLost`."""
        client, old = self.client, len(self.workers)
        self.generation += 1
        world = old + len(joined)
        snapshot = None
        if joined:
            snapshot = self._submit(
                remote.replica_snapshot,
                0,
                self.last_futures[0],
                key=f"snapshot@replica0-{self.run_id}-g{self.generation}",
            )
        self.workers = self.workers + joined
        try:
            host, port = self._rendezvous(world, self.generation)
            regroups = [
                self._submit(
                    remote.regroup_replica,
                    r,
                    world,
                    host,
                    port,
                    self.generation,
                    self.last_futures[r],
                    key=f"regroup@replica{r}-{self.run_id}-g{self.generation}",
                )
                for r in range(old)
            ]
            setups = self._setup_replicas(
                list(enumerate(joined, start=old)),
                world,
                host,
                port,
                self.generation,
                snapshot,
                spec=self.spec,
            )
            infos = self._gather(setups)
            self._gather(regroups)
        except WorkersLost as lost:
            # Back to the replicas from before; the joiners are tried again later.
            joined_alive = [a for a in joined if a not in lost.workers]
            _quietly(
                lambda: client.run(
                    remote.close_run_soon, self.run_id, workers=joined_alive, wait=False
                )
            )
            self.workers = self.workers[:old]
            raise WorkersLost([a for a in lost.workers if a in self.workers]) from None
        self.last_futures = regroups + setups
        self.history.info["replicas"] = world
        if joined:
            self.history.info["workers"] += infos
            self.history.info["regroups"].append(
                {"phase": getattr(phase, "index", None), "replicas": world, "joined": joined}
            )
        return joined

    def _available_workers(self) -> list[str]:
        workers = live_workers(self.client)
        return sorted(workers, key=lambda a: (workers[a].get("host", ""), a))

    def _request_workers(self, phase: PhaseSpec) -> None:
        """``scale_with_batch``: enough workers that no replica's batch exceeds the cap."""
        config = self.config
        wanted = min(config.max_workers, math.ceil(phase.global_batch / config.max_micro_batch))
        if wanted <= len(self._available_workers()):
            return
        cluster = getattr(self.client, "cluster", None)
        scaling = {"phase": phase.index, "requested": wanted}
        if cluster is None or not hasattr(cluster, "scale"):
            scaling["error"] = (
                "the client has no cluster object to scale (connected by address?); start "
                "more workers yourself, they join at the next phase"
            )
        else:
            cluster.scale(wanted)
            try:
                self.client.wait_for_workers(wanted, timeout=config.scale_timeout_s)
            except TimeoutError:
                scaling["error"] = f"only some workers arrived in {config.scale_timeout_s} s"
        scaling["workers"] = len(self._available_workers())
        self.history.info.setdefault("scaling", []).append(scaling)

    def _submit(self, fn: Any, rank: int, *args: Any, key: str) -> Any:
        future = self.client.submit(
            fn,
            self.run_id,
            *args,
            workers=[self.workers[rank]],
            allow_other_workers=False,
            pure=False,
            key=key,
        )
        self.in_flight.append((future, self.workers[rank]))  # what a recovery must stop
        return future

    def _run_phases(self) -> None:
        epoch, previous, index, measurement = self.start
        self.step_seconds: float | None = None
        while epoch < self.epochs:
            self.in_flight = []
            resumed, self.resume_in_phase = self.resume_in_phase, None
            if resumed is None:
                phase = self.trainer.next_phase(epoch, self.epochs, previous, measurement)
                self.lr_factor, self.rollbacks = 1.0, 0  # on_non_finite="rollback", per phase
                self.phase_pairs, self.carried_totals = [], []
                if previous is not None:
                    self._surviving(phase, self._grow, phase)
                steps = self.trainer._phase_steps(phase, len(self.workers), index, self._measured())
                segment, todo, continued = steps, steps, False
            else:  # resumed from a mid-phase checkpoint: the rest of its phase
                phase, steps, todo = resumed.phase, resumed.steps, self._resumed_steps(resumed)
                self.lr_factor, self.rollbacks = resumed.lr_factor, resumed.rollbacks
                self.phase_pairs = list(resumed.norm_pairs)
                same_world = len(resumed.totals) == len(self.workers)
                self.carried_totals = resumed.totals if same_world else []
                segment, continued = todo, True
            self.phase_steps = steps
            phase_started = time.perf_counter()
            results: list[list[Any]] = [[] for _ in self.workers]
            self.phase_results = results
            bar = tqdm(
                total=len(steps),
                initial=todo[0].index - steps[0].index if todo else 0,
                desc=f"phase {phase.index} (B={phase.global_batch})",
                unit="step",
                disable=not self.config.progress,
                dynamic_ncols=True,
            )
            # A lost worker ends a segment: the survivors roll back to the last committed
            # window and the phase's remaining steps are split over them.
            try:
                while True:
                    try:
                        if todo:
                            self._run_segment(phase, todo, results, bar, continued)
                        ends = self._gather(
                            [
                                self._submit(
                                    remote.end_phase,
                                    r,
                                    self.last_futures[r],
                                    self.generation,
                                    key=f"end-phase@replica{r}-{self.run_id}-p{phase.index}"
                                    f"{self._generation_tag()}",
                                )
                                for r in range(len(self.workers))
                            ]
                        )
                        break
                    except WorkersLost as lost:
                        todo = self._recover(lost, phase, segment, results)
                        segment, continued = todo or segment, True
                    except NonFiniteError as error:
                        if not self._may_roll_back(error):
                            raise
                        todo = self._recover(WorkersLost([]), phase, segment, results, error)
                        segment, continued = todo or segment, True
            finally:
                bar.close()
            digests = {end["weights_digest"] for end in ends}
            if len(digests) != 1:
                raise ReplicaError(
                    f"replica weights diverged after phase {phase.index}: digests {digests}"
                )
            self._check_epochs_complete(steps)
            self._track_noise(self.phase_pairs)
            totals = self._phase_totals(results)
            seconds = time.perf_counter() - phase_started
            self._record_phase(phase, segment, totals, ends, seconds)
            measurement = PhaseMeasurement(
                noise_scale=self.noise.noise_scale,
                gradient_sq=self.noise.gradient_sq,
                trace_cov=self.noise.trace_cov,
                samples_per_second=sum(self.history.phases[-1]["samples_per_second"]),
                steps=len(steps),
                measured_steps=self.noise.steps,
            )
            index = steps[0].index + len(steps)
            if self.store is not None:
                self._surviving(phase, self._save_checkpoint, phase, index, measurement)
            epoch, previous = phase.end_epoch, phase
            self.last_phase = phase

    def _resumed_steps(self, progress: PhaseProgress) -> tuple:
        """The steps of a phase left after a mid-phase checkpoint. On as many replicas as
        it was written on, each keeps its split, so every replica reads what it would
        have read uninterrupted (bit-identical); on another count, split evenly."""
        world = len(self.workers)
        if len(progress.segment[0].local_batches) == world:
            return resplit_steps(progress.segment, self.resume_step, split=None)
        return resplit_steps(
            progress.segment,
            self.resume_step,
            split=lambda size: self.config.balancer.split(size, world, []),
            micro_batches=self.trainer._micro_batches(world, after_loss=True),
        )

    def _phase_totals(self, results: list[list[Any]]) -> list[ReplicaTotals]:
        """Each replica's work in the phase: its windows, and what a mid-phase checkpoint
        carried over from before the resume."""
        totals = [ReplicaTotals.of_windows(windows) for windows in results]
        if len(self.carried_totals) == len(totals):
            totals = [c.merged(t) for c, t in zip(self.carried_totals, totals, strict=True)]
        return totals

    def _measured(self) -> list[list[float]]:
        """Per past phase, the samples/s of each replica of the current set (the balancer's
        input); after a lost worker, replica r may be a different process than before."""
        return [p["samples_per_second"] for p in self.history.phases]

    def _generation_tag(self) -> str:
        return f"-g{self.generation}" if self.generation else ""

    def _run_segment(
        self,
        phase: PhaseSpec,
        steps: tuple,
        results: list[list[Any]],
        bar: Any,
        continued: bool,
    ) -> None:
        """Run ``steps`` of ``phase`` on the current replicas, window by window."""
        world, tag = len(self.workers), self._generation_tag()
        self.committed_step = steps[0].index
        self.segment = steps  # the steps' epoch layout, to salvage a lost replica's windows
        self.checkpoint_countdown = self.checkpoint_every or 0
        context = PhaseContext(
            index=phase.index,
            steps=steps,
            lr=phase.lr,
            lr_scale=phase.lr_scale,
            warmup_steps=phase.warmup_steps,
            measure_noise=self.trainer.measures_noise,
            continued=continued,
            lr_factor=self.lr_factor,
        )
        self.last_futures = [
            self._submit(
                remote.begin_phase,
                r,
                context,
                self.last_futures[r],
                self.generation,
                key=f"begin-phase@replica{r}-{self.run_id}-p{phase.index}{tag}",
            )
            for r in range(world)
        ]
        done = 0
        if self.step_seconds is None:  # measure before fusing steps into windows
            calibration = Plan.build(
                self.order,
                phase,
                steps[:CALIBRATION_STEPS],
                world,
                tag=f"calibrate{tag}",
                run=self.run_id,
            )
            self._run_plan(calibration, results, bar)
            done = len(calibration.steps)
            self.step_seconds = self._measured_step_seconds(results)
        if done < len(steps):
            plan = Plan.build(
                self.order,
                phase,
                steps[done:],
                world,
                step_seconds=self.step_seconds,
                window_seconds=self.config.window_seconds,
                tag=f"train{tag}",
                run=self.run_id,
            )
            if self.config.progress:
                bar.write(str(plan).splitlines()[0])
            self._run_plan(plan, results, bar)
        self.step_seconds = self._measured_step_seconds(results)

    # -- lost workers -------------------------------------------------------------------
    def _lost_workers(self) -> list[str]:
        """The fit's workers the scheduler no longer has (dead, or restarted by a nanny
        under a new address)."""
        alive = live_workers(self.client)
        return [a for a in self.workers if a not in alive]

    def _gather(self, futures: list[Any]) -> list[Any]:
        """``client.gather`` that cannot hang on a dead worker: a task pinned to a worker
        that is gone never runs, so the workers are watched while waiting."""
        pending = list(futures)
        while pending:
            done, pending = _wait_some(pending)
            if any(f.status == "error" for f in done) or pending:
                self._raise_if_lost(grace=any(f.status == "error" for f in done))
        return [self._result(f) for f in futures]

    def _result(self, future: Any) -> Any:
        """``future.result()``, watching the workers: a result held by a worker that died
        is recomputed by Dask, on that (pinned, gone) worker, i.e. never."""
        while True:
            try:
                return future.result(timeout=LIVENESS_POLL_S)
            except TimeoutError:
                self._raise_if_lost()
            except CancelledError:  # its inputs died with a worker: that worker is lost
                self._raise_if_lost(grace=True)
                raise

    def _raise_if_lost(self, grace: bool = False) -> None:
        """Raise :class:`WorkersLost` if a worker of the fit is gone. With ``grace`` (a task
        just failed, maybe because a peer died) wait a little for the scheduler to notice."""
        deadline = time.monotonic() + (FAILURE_GRACE_S if grace else 0.0)
        while True:
            lost = self._lost_workers() if self.config.recover_lost_workers else []
            if lost:
                raise WorkersLost(lost)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _recover(
        self,
        lost: WorkersLost,
        phase: PhaseSpec,
        segment: tuple,
        results: list[list[Any]],
        non_finite: NonFiniteError | None = None,
    ) -> tuple:
        """:meth:`_recover_once`, again if more workers die while it runs."""
        if non_finite is not None:
            self.lr_factor *= NON_FINITE_LR_CUT
        while True:
            try:
                return self._recover_once(lost, phase, segment, results, non_finite)
            except WorkersLost as again:
                lost, non_finite = again, None

    def _may_roll_back(self, error: NonFiniteError) -> bool:
        """``on_non_finite="rollback"``: at most ``MAX_ROLLBACKS`` per phase."""
        if not self.trainer.rolls_back_non_finite or self.rollbacks >= MAX_ROLLBACKS:
            return False
        self.rollbacks += 1
        if self.config.progress:
            print(f"dataflow: {error}; rolling back to step {self.committed_step}, LR x 0.5")
        return True

    def _recover_once(
        self,
        lost: WorkersLost,
        phase: PhaseSpec,
        segment: tuple,
        results: list[list[Any]],
        non_finite: NonFiniteError | None = None,
    ) -> tuple:
        """Go on without the lost workers: stop what runs, roll the survivors back to the
        last committed window, form a new process group on them, and split the phase's
        remaining steps over them. Returns those steps."""
        detected = time.time()
        survivors = [(r, a) for r, a in enumerate(self.workers) if a not in lost.workers]
        record = {
            "phase": getattr(phase, "index", None),
            "reason": "lost workers" if non_finite is None else "non-finite",
            "lost": list(lost.workers),
            "detected_at": detected,
            "commit_step": self.committed_step,
            "replicas_before": len(self.workers),
            "replicas_after": len(survivors),
        }
        if non_finite is not None:
            record.update(error=str(non_finite), lr_factor=self.lr_factor)
        self.history.info.setdefault("failures", []).append(record)
        if self.config.progress and non_finite is None:
            print(
                f"dataflow: lost worker(s) {', '.join(lost.workers)}; rolling back to step "
                f"{self.committed_step} on {len(survivors)} replica(s)"
            )
        alive = [a for _, a in survivors]
        if not alive:  # nothing to roll back: the newest checkpoint is the way on
            raise AllReplicasLost(lost, record["phase"])
        # Stop the survivors' windows: leave the broken group (their blocked collectives
        # fail), wait for what runs to end, and drop what was queued behind it.
        _quietly(  # not waiting: a worker that died but is not yet noticed would stall it
            lambda: self.client.run(remote.abort_run_soon, self.run_id, workers=alive, wait=False)
        )
        running = [f for f, address in self.in_flight if address in alive and not f.done()]
        _quietly(lambda: wait(running, timeout=self.config.collective_timeout_s))
        # Dropped, not cancelled: cancelling a chain of dependent futures can trip the
        # scheduler (and cut the client off); a dropped task that still runs on a
        # survivor finds a newer process-group generation there and refuses.
        self.in_flight = []
        self.workers = alive
        results[:] = [results[old] for old, _ in survivors]
        if self.carried_totals:  # from before a resume: re-indexed like the results
            self.carried_totals = [self.carried_totals[old] for old, _ in survivors]
        self.history.info["replicas"] = len(alive)
        rollbacks = [
            self._submit(
                remote.rollback_replica,
                rank,
                self.committed_step,
                rank,
                key=f"rollback@replica{rank}-{self.run_id}-r{len(self.history.info['failures'])}",
            )
            for rank in range(len(alive))
        ]
        self._gather(rollbacks)
        self.last_futures = rollbacks
        joinable = self._joinable()
        if len(alive) + len(joinable) < self.config.min_workers:
            saved = self._save_survivors(phase) if segment and self.store is not None else None
            raise self._too_few_error(lost, record["phase"], saved)
        # Workers that joined (a nanny's restart of a lost one) take part at once.
        joined = self._form_group(joinable, phase)
        results.extend([] for _ in joined)
        if self.carried_totals:
            self.carried_totals.extend(ReplicaTotals() for _ in joined)
        world = len(self.workers)
        record["joined"] = joined
        rest = resplit_steps(
            segment,
            self.committed_step,
            split=lambda size: self.config.balancer.split(size, world, []),
            micro_batches=self.trainer._micro_batches(world, after_loss=True),
        )
        # At most the window in progress is lost: its steps run again on the survivors.
        in_progress = self.window_stops.get(self.committed_step, self.committed_step)
        record.update(resumed_at=time.time(), window_steps_lost=in_progress - self.committed_step)
        return rest

    def _save_survivors(self, phase: PhaseSpec) -> Path | None:
        """Before giving up on too few workers: a mid-phase checkpoint of the commit the
        survivors just rolled back to, so the work up to it is kept on disk."""
        try:
            states = self._replica_states(f"lost{len(self.history.info['failures'])}")
            return self._save_mid_phase(phase, states)
        except WorkersLost:  # the last survivors died too: the newest checkpoint stands
            return None

    def _too_few_error(
        self, lost: WorkersLost, phase: int | None, saved: Path | None
    ) -> WorkerLostError:
        """WorkerLostError, saying where the work done so far is kept."""
        if saved is not None:
            where = (
                f"A checkpoint of step {self.committed_step} (the last window every replica "
                f"finished) was written to {saved}; "
            )
        elif self.store is not None:
            newest = self.store.latest()
            where = (
                f"The newest checkpoint is {newest}; "
                if newest is not None
                else f"No checkpoint was written yet in {self.store.directory}; "
            )
        else:
            where = "No checkpoint_dir was given, so the work done is lost; "
        remain = len([a for a in self.workers if a not in lost.workers])
        return WorkerLostError(
            f"lost worker(s) {', '.join(lost.workers)} in phase {phase}; "
            f"{remain} remain but min_workers={self.config.min_workers}. {where}"
            "fit(..., checkpoint_dir=..., resume=True) continues from the newest checkpoint "
            "once workers are back"
        )

    def _regroup_after_loss(self, lost: WorkersLost, phase: PhaseSpec) -> None:
        """A loss between segments (a phase boundary): the survivors are all at the
        commit; re-form their group so the next collective does not wait for the dead."""
        self._recover(lost, phase, (), [[] for _ in self.workers])

    def _surviving(self, phase: PhaseSpec | None, action: Any, *args: Any) -> Any:
        """Run ``action(*args)`` (driver work that waits on replicas at a phase boundary)
        again on the survivors if a worker is lost meanwhile."""
        while True:
            try:
                return action(*args)
            except WorkersLost as lost:
                self._regroup_after_loss(lost, phase)

    def _track_noise(self, pairs: list[tuple]) -> None:
        """Feed the committed steps' gradient-norm pairs to the noise-scale tracker, in
        step order (all replicas' pairs of one step together)."""
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

    def _measured_step_seconds(self, results: list[list[Any]]) -> float:
        """The median over recent steps of the slowest replica's step time."""
        last = [r[-1].step_seconds for r in results if r]  # joiners have no windows yet
        per_step = [max(values) for values in zip(*last, strict=True)]
        tail = per_step[1:] if len(per_step) > 1 else per_step
        return statistics.median(tail)

    def _run_plan(self, plan: Plan, results: list[list[Any]], bar: Any) -> None:
        futures = {}
        checkpoints: frozenset[int] = frozenset()
        if self.checkpoint_every and self.store is not None:
            checkpoints, self.checkpoint_countdown = checkpoint_windows(
                plan,
                self.checkpoint_every,
                self.checkpoint_countdown,
                phase_stop=self.phase_steps[-1].index + 1,
            )
        for task in plan.tasks():
            window = task.window
            first = plan.steps[window.first].index
            stop = plan.steps[window.stop - 1].index + 1
            self.window_stops[first] = stop
            future = self._submit(
                remote.run_window,
                task.replica,
                first,
                stop,
                self.last_futures[task.replica],
                self.generation,
                window.index in checkpoints,
                key=task.key,
            )
            self.last_futures[task.replica] = future
            futures[future] = (task.replica, window.index)
        try:
            self._collect(plan, futures, results, bar)
        except WorkersLost:
            raise  # the recovery stops the survivors' windows in order
        except BaseException:
            self.client.cancel(list(futures))
            raise

    def _collect(
        self, plan: Plan, futures: dict[Any, tuple[int, int]], results: list[list[Any]], bar: Any
    ) -> None:
        """Fold window results into the history in step order, as they arrive, while
        watching the workers (a task pinned to a dead worker would wait forever)."""
        pending: dict[int, dict[int, Any]] = defaultdict(dict)
        self.next_window = 0
        try:
            self._collect_windows(plan, futures, pending, results, bar)
        except WorkersLost as lost:
            self._salvage(plan, pending, lost, results, bar)
            raise

    def _collect_windows(
        self,
        plan: Plan,
        futures: dict[Any, tuple[int, int]],
        pending: dict[int, dict[int, Any]],
        results: list[list[Any]],
        bar: Any,
    ) -> None:
        waiting = list(futures)
        while waiting:
            done, waiting = _wait_some(waiting)
            if not done:
                self._raise_if_lost()
                continue
            for future in done:
                rank, window_index = futures[future]
                if future.status == "cancelled":  # its inputs died with a worker
                    self._raise_if_lost(grace=True)
                    raise ReplicaError(f"window {window_index} of replica {rank} was cancelled")
                if future.status != "finished":
                    error = future.exception()
                    if isinstance(error, NonFiniteError) and self.trainer.rolls_back_non_finite:
                        raise error  # every replica saw the same reduced gradient
                    self._raise_if_lost(grace=True)
                    raise self._root_cause(futures)
                pending[window_index][rank] = self._result(future)
            while len(pending.get(self.next_window, {})) == plan.replicas:
                self._commit_window(plan, pending.pop(self.next_window), results, bar)

    def _commit_window(
        self, plan: Plan, window_results: dict[int, Any], results: list[list[Any]], bar: Any
    ) -> None:
        window = [window_results[r] for r in range(plan.replicas)]
        states = [w.checkpoint for w in window]
        for r, w in enumerate(window):
            w.checkpoint = None  # the history keeps the window's numbers, not its weights
            results[r].append(w)
        self._record_steps(plan, window, bar)
        self.next_window += 1
        # Every replica's state at the window's end (a replica lost before it gave its
        # own, salvaged from the plan, has none: wait for the next checkpoint window).
        if all(state is not None for state in states):
            self._save_mid_phase(plan.phase, states)

    def _salvage(
        self,
        plan: Plan,
        pending: dict[int, dict[int, Any]],
        lost: WorkersLost,
        results: list[list[Any]],
        bar: Any,
    ) -> None:
        """Commit the windows every survivor finished although a lost replica's result
        never arrived (it died holding it): the survivors' allreduces could not finish
        without it, so it trained those steps too. Its samples come from the plan (pure),
        its losses are unknown (the step's loss is the others' mean). Without this, a
        death just after a window would cost that window as well as the next."""
        dead = {r for r in range(plan.replicas) if self.workers[r] in lost.workers}
        alive = [r for r in range(plan.replicas) if r not in dead]
        if not dead or not alive:
            return
        streams = None
        while all(r in pending.get(self.next_window, {}) for r in alive):
            if streams is None:
                streams = {
                    spec.index: parts
                    for spec, parts in self.trainer.load.streams(self.segment, self.config.seed)
                }
            got = pending.pop(self.next_window)
            window = plan.windows[self.next_window]
            specs = plan.steps[window.first : window.stop]
            for r in dead:
                if r not in got:
                    got[r] = remote.WindowResult(
                        rank=r,
                        first_step=specs[0].index,
                        samples=[spec.local_batches[r] for spec in specs],
                        losses=[None] * len(specs),
                        step_seconds=[0.0] * len(specs),
                        stage_seconds={},
                        task_seconds=0.0,
                        sample_indices=[streams[spec.index][r] for spec in specs],
                    )
            self._commit_window(plan, got, results, bar)

    def _root_cause(self, futures: dict[Any, tuple[int, int]]) -> BaseException:
        """The first real failure: a peer's "connection closed" is only its echo."""
        try:
            wait(list(futures), timeout=FAILURE_GRACE_S)
        except TimeoutError:
            pass
        failed = sorted(
            ((window, rank), future)
            for future, (rank, window) in futures.items()
            if future.status == "error"
        )
        real = [item for item in failed if not isinstance(item[1].exception(), CollectiveError)]
        (_, rank), future = (real or failed)[0]
        return _replica_failure(future, rank, self.workers[rank])

    def _record_steps(self, plan: Plan, window: list[Any], bar: Any) -> None:
        first = window[0].first_step
        offset = first - plan.steps[0].index
        consumed: dict[tuple[int, int], list[Any]] = defaultdict(list)
        for i in range(len(window[0].samples)):
            spec = plan.steps[offset + i]
            local = [(w.losses[i], w.samples[i]) for w in window]
            total = sum(n for _, n in local)
            # A lost replica's window salvaged from the plan has no losses: the mean of the others.
            known = [(value, n) for value, n in local if n and value is not None]
            loss = sum(value * n for value, n in known) / max(sum(n for _, n in known), 1)
            if not math.isfinite(loss) and not self.trainer.skips_non_finite:
                raise LossError(
                    f"the loss is {loss} at step {spec.index} (epoch {spec.epoch}); training "
                    "diverged: lower the learning rate or check the inputs for NaN/inf"
                )
            self.history.steps.append(
                {
                    "step": spec.index,
                    "phase": plan.phase.index,
                    "epoch": spec.epoch,
                    "loss": loss,
                    "samples": total,
                    "seconds": max(w.step_seconds[i] for w in window),
                    "time": time.perf_counter() - self.train_started,
                }
            )
            for rank, w in enumerate(window):  # the window is committed: its samples count
                if w.sample_indices and w.sample_indices[i] is not None:
                    consumed[(spec.epoch, rank)].append(w.sample_indices[i])
            self.committed_step = spec.index + 1
            self.samples_seen += total
            if math.isfinite(loss):  # a dropped non-finite step does not poison the mean
                self.epoch_loss_sum += loss * total
                self.epoch_samples += total
            if spec.last_in_epoch:
                self._record_epoch(spec, window)
        # Once per window and replica: each record scans the epoch's bitmap.
        for (epoch, rank), parts in consumed.items():
            self.ledger.record(epoch, rank, np.concatenate(parts))
        for w in window:  # so do its gradient-norm pairs (the noise scale)
            self.phase_pairs.extend(w.norm_pairs)
        elapsed = time.perf_counter() - self.train_started
        bar.update(len(window[0].samples))
        bar.set_postfix(
            epoch=self.history.steps[-1]["epoch"],
            loss=f"{self.history.steps[-1]['loss']:.4g}",
            samples_s=f"{self.samples_seen / elapsed:.0f}",
            refresh=False,
        )

    def _record_epoch(self, spec: Any, window: list[Any]) -> None:
        row: dict[str, Any] = {
            "epoch": spec.epoch,
            "train_loss": self.epoch_loss_sum / max(self.epoch_samples, 1),
        }
        self.epoch_loss_sum, self.epoch_samples = 0.0, 0
        evals = [w.evals[spec.index] for w in window if spec.index in w.evals]
        if evals:
            count = sum(e["count"] for e in evals)
            for key in evals[0]:
                if key != "count":
                    row[f"eval_{key}"] = sum(e[key] for e in evals) / max(count, 1)
        self.history.epochs.append(row)

    def _record_phase(
        self,
        phase: PhaseSpec,
        steps: tuple,
        totals: list[ReplicaTotals],
        ends: list[dict],
        seconds: float,
    ) -> None:
        rates, data_wait = [], []
        graph = self.trainer.graph
        loads = {name for name in self.order if isinstance(graph[name], Load)}
        for replica in totals:
            stages = replica.stage_seconds
            compute = sum(
                v
                for name, v in stages.items()
                if name not in graph or not remote.is_waiting(graph[name])
            )
            rates.append(replica.samples / compute if compute > 0 else 0.0)
            total = sum(stages.values())
            data_wait.append(sum(stages.get(n, 0.0) for n in loads) / total if total > 0 else 0.0)
        self.history.phases.append(
            {
                "phase": phase.index,
                "start_epoch": phase.start_epoch,
                "end_epoch": phase.end_epoch,
                "global_batch": phase.global_batch,
                "lr": ends[0].get("lr", phase.lr),
                "local_batches": list(steps[0].local_batches),
                "micro_batches": list(steps[0].micro_batches or [1] * len(steps[0].local_batches)),
                "replicas": len(steps[0].local_batches),
                "noise_scale": phase.noise_scale,  # the estimate this phase was chosen from
                "gain": phase.gain,  # the LR gain the schedule applied (Adaptive)
                "measured_noise_scale": self.noise.noise_scale,  # after this phase's steps
                "samples_per_second": rates,
                "steps": len(self.phase_steps),
                "windows": totals[0].windows,
                "seconds": seconds,
                "task_seconds": [t.task_seconds for t in totals],
                "stage_seconds": [dict(t.stage_seconds) for t in totals],
                "data_wait_fraction": data_wait,  # per replica: share of step time in Load
                "chunks_decoded": [end.get("chunks_decoded", 0) for end in ends],
                "peak_buffered_samples": [end.get("peak_buffered_samples", 0) for end in ends],
                "skipped_steps": ends[0].get("skipped_steps", 0),  # non-finite, dropped
            }
        )


def _replica_failure(future: Any, rank: int, worker: str) -> BaseException:
    exc = future.exception()
    if isinstance(exc, Exception) and type(exc).__module__.startswith("dataflow"):
        return exc
    error = ReplicaError(f"replica {rank} on worker {worker} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _wait_some(futures: list[Any]) -> tuple[list[Any], list[Any]]:
    """The futures done within ``LIVENESS_POLL_S`` (maybe none), and the others."""
    try:
        wait(futures, timeout=LIVENESS_POLL_S, return_when="FIRST_COMPLETED")
    except (TimeoutError, CancelledError):  # distributed.wait raises where concurrent's
        pass  # returns; a cancelled future (its inputs died with a worker) is done
    done = [f for f in futures if f.done()]
    return done, [f for f in futures if not f.done()]


def _json_plain(value: Any) -> Any:
    """Plain containers only (tuples as lists), so a checkpoint loads with weights_only."""
    if isinstance(value, dict):
        return {str(k): _json_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _quietly(action: Any) -> None:
    try:
        action()
    except Exception:  # cleanup after the real error, which is what the user must see
        pass
