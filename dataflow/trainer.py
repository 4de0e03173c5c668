"""The trainer: a graph, a schedule and a config; ``fit`` runs them on a cluster.

What the fit does on the driver lives in :mod:`dataflow.driver` (a pure state
machine, the planner, the recorder, the one executor that talks to Dask); this
module checks what the user gave, offers the cluster-free views (``plan``,
``sample_plan``, a dry run) and opens the checkpoints.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from distributed import Client

from dataflow.callbacks import as_keep_best, check_callbacks
from dataflow.checkpoint import Checkpoint, CheckpointStore, fingerprint
from dataflow.core import kinds
from dataflow.core.errors import BatchSizeError, ConfigError, DataError
from dataflow.core.phase import PhaseSpec
from dataflow.core.protocols import Schedule
from dataflow.driver.fit import run_fit
from dataflow.driver.fit_settings import FitPlan, plan_fit
from dataflow.driver.segments import Planner
from dataflow.graph import Graph
from dataflow.history.result import FitResult
from dataflow.label_watch import watch_labels
from dataflow.planning.layout import Layout
from dataflow.planning.layout_choice import check_transforms
from dataflow.planning.plan import Plan, Plans, phase_steps
from dataflow.runtime.cluster import client_or_local_cluster
from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec
from dataflow.schedule.decay import LRDecay
from dataflow.stages import Forward, Load, Update
from dataflow.stages.base import PhaseContext
from dataflow.stages.evaluate import bind_evaluations
from dataflow.stages.forward import build_model
from dataflow.stages.held_out_checks import check_held_out_chunks
from dataflow.trainer_config import TrainerConfig, check_options

__all__ = ["Trainer", "TrainerConfig"]


def check_sync_batchnorm(graph: Graph, config: TrainerConfig, measures_noise: bool) -> None:
    """``sync_batchnorm=True`` only where every replica runs every step's forward at once:
    synchronous sample-parallel training, eager (a ConfigError naming the clash); and not
    with a schedule that measures the gradient noise scale (``measures_noise``): each
    replica's gradient then depends on the others' batch statistics, so it is no gradient
    of its own samples alone, and the noise estimate from the two (small-batch |g|^2
    against the global batch's) is wrong: |G|^2 came out below 0 in every phase on a
    BatchNorm CNN, so ``Adaptive`` never grew the batch and AdaScale's gain took the
    linear rule, silently."""
    if not any(getattr(s.config, "sync_batchnorm", False) for s in graph if isinstance(s, Forward)):
        return
    clash = None
    if measures_noise:
        clash = (
            "a schedule that measures the gradient noise scale (Adaptive, or Stepwise with "
            "lr_scaling='adascale', its default): with statistics over every replica, no "
            "replica's gradient is one of its own samples alone, which the measurement "
            "needs (it read the noise as unresolvable, so Adaptive would never grow the "
            "batch and AdaScale would scale the LR linearly); give Stepwise a fixed rule "
            "(lr_scaling='linear', 'sqrt' or 'none'), or use sync_batchnorm=False"
        )
    elif config.settles_at_window_end:
        clash = (
            f"sync={type(config.sync).__name__}: its replicas run their steps apart, "
            "while the statistics are reduced over every replica at once"
        )
    elif config.capture:
        clash = "capture=True: a CUDA graph replay would run no reduction"
    elif config.compile:
        clash = f"compile={config.compile!r}: torch.compile would break its graph at each layer"
    if clash is not None:
        raise ConfigError(f"sync_batchnorm=True with {clash}; use sync_batchnorm=False")


class Trainer:
    """Runs ``graph`` under ``schedule``; see :class:`dataflow.Pipeline` for the usual graph."""

    def __init__(
        self, graph: Graph, *, schedule: Schedule, lr_decay: LRDecay | None = None, **config: Any
    ) -> None:
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
        if lr_decay is not None and not isinstance(lr_decay, LRDecay):
            raise ConfigError(
                f"lr_decay={lr_decay!r}: give a dataflow.schedule decay such as "
                "CosineDecay(warmup_epochs=5), StepDecay({30: 0.1, 60: 0.01}) or None"
            )
        self.graph = graph
        self.schedule = schedule
        self.lr_decay = lr_decay
        bind_evaluations(graph)  # Evaluate applies the graph's deterministic transforms
        check_options(config)
        self.config = TrainerConfig(**config)
        loads = [s for s in graph if isinstance(s, Load)]
        if not loads:
            raise ConfigError("the graph has no Load stage: add g.add(stages.Load(source))")
        self.load = loads[0]
        self.source = loads[0].source
        self.drop_last = loads[0].config.drop_last
        forwards = [s for s in graph if isinstance(s, Forward)]
        self.model_factory = forwards[0].config.model if forwards else None
        # the gradient allreduces, and the bytes they move per fp32 byte (a custom
        # allreduce stage without a wire dtype moves fp32)
        self.reducers = [s for s in graph if s.kind == kinds.ALLREDUCE]
        narrow = [s.name for s in self.reducers if getattr(s, "wire_scale", 1.0) != 1.0]
        self.wire_scale = min((getattr(s, "wire_scale", 1.0) for s in self.reducers), default=1.0)
        if narrow and self.config.settles_at_window_end:
            raise ConfigError(
                f"allreduce dtype 'bf16' (stage {narrow[0]!r}) with sync="
                f"{type(self.config.sync).__name__}: only synchronous gradient allreduces "
                "travel narrowed (local and asynchronous updates move weights, which bf16 "
                "would round); use allreduce_dtype='fp32' or the default synchronous sync"
            )
        self.measures_noise = bool(getattr(schedule, "measures_noise", False))
        # on_non_finite: with "skip" a NaN step loss is a dropped step, not a failure; with
        # "rollback" the driver goes back to the last commit with half the LR.
        policies = {s.config.on_non_finite for s in graph if isinstance(s, Update)}
        self.skips_non_finite = "skip" in policies
        self.rolls_back_non_finite = "rollback" in policies
        check_sync_batchnorm(graph, self.config, self.measures_noise)
        # ema_decay: a moving average of the weights, kept in the optimizer's state
        self.averages_weights = any(
            s.config.ema_decay is not None for s in graph if isinstance(s, Update)
        )

    def fit_plan(self, replicas: int, global_batch: int) -> FitPlan:
        """The window length and bucket size a fit on ``replicas`` at ``global_batch``
        uses (the user's, the cost model's or the defaults; ``driver/fit_settings.py``)."""
        user_bucket = next((r.config.bucket_mb for r in self.reducers if r.config.bucket_mb), None)
        return plan_fit(
            self.config,
            user_bucket_mb=user_bucket,
            replicas=replicas,
            global_batch=global_batch,
            wire_scale=self.wire_scale,
        )

    def epoch_keys(self) -> set[str]:
        """The metrics every epoch record of this graph's fits has: the training loss,
        and each evaluation metric (``eval_<name>``) when the graph evaluates."""
        keys = {"train_loss"}
        for stage in self.graph:
            if stage.kind == kinds.EVALUATE:
                keys |= {f"eval_{name}" for name in stage.config.metrics}
                if self.averages_weights:  # ema_decay: the average's too
                    keys |= {f"eval_ema_{name}" for name in stage.config.metrics}
        return keys

    def metric_every(self, metric: str) -> int:
        """Every how many epochs a record has ``metric``: an evaluation metric as often as
        its Evaluate stage scores (``every_epochs``), the training loss every epoch."""
        for stage in self.graph:
            if stage.kind == kinds.EVALUATE and metric in {
                f"eval_{prefix}{name}" for name in stage.config.metrics for prefix in ("", "ema_")
            }:
                return stage.config.every_epochs
        return 1

    def planner(self, epochs: int | None = None) -> Planner:
        """The fit's plans (schedule, balancer, split, micro-batches, the LR's decay over
        ``epochs``), pure."""
        return Planner(
            schedule=self.schedule,
            balancer=self.config.balancer,
            num_samples=self.source.num_samples,
            drop_last=self.drop_last,
            max_micro_batch=self.config.max_micro_batch,
            measures_noise=self.measures_noise,
            lr_decay=self.lr_decay,
            epochs=epochs,
            paired_micro_batches=any(s.pairs_micro_batches for s in self.graph),
        )

    # -- inspection, no cluster ---------------------------------------------------------
    def plan(
        self, epochs: int, replicas: int | Sequence[int], *, step_seconds: float | None = None
    ) -> Plans:
        """The plans a fit of ``epochs`` on ``replicas`` would run (first phase's view).

        ``replicas`` may list the replica count of each phase (the last one repeats), as
        in a fit where workers joined between phases (``history.phases[i]["replicas"]``).
        """
        _check_epochs(epochs, self.lr_decay)
        counts = [replicas] if isinstance(replicas, int) else list(replicas)
        plans, epoch, previous, index = Plans(), 0, None, 0
        planner = self.planner(epochs)
        layout = self.config.layout.describe() if isinstance(self.config.layout, Layout) else ""
        if self.config.layout == "auto" or self.config.memory_per_worker is not None:
            # with "auto", ``replicas`` counts workers: groups follow from the choice
            layout, size = self._layout_table(counts[0] * self.config.spatial, epochs)
            if self.config.layout == "auto":
                counts = [max(1, c // size) for c in counts]
        while planner.counts_progress or epoch < epochs:  # (progress: until no phase)
            world = counts[min(len(plans), len(counts) - 1)]
            order = self.graph.validate(replicas=world)
            phase = planner.next_phase(epoch, epochs, previous)
            if phase is None:
                break
            steps = planner.phase_steps(phase, world, index)
            plans.append(
                Plan.build(
                    order,
                    phase,
                    steps,
                    world,
                    step_seconds=step_seconds,
                    window_seconds=self.fit_plan(world, phase.global_batch).window_seconds,
                    window_steps=self.config.window_steps,
                    window_samples=self.config.sync.period_samples,
                    epoch_ends_window=self.config.settles_at_window_end,
                    layout=layout,
                    sync=self.config.sync.describe() if self.config.settles_at_window_end else "",
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
        on_epoch: Any = None,
        keep_best: Any = None,
    ) -> FitResult:
        """Train for ``epochs``. With ``checkpoint_dir``, a checkpoint is written
        atomically at every phase boundary, and inside a phase every
        ``checkpoint_every`` windows (a window is about ``window_seconds`` of work);
        ``resume=True`` continues from the newest valid one there (refused, with the
        differences listed, if it belongs to another model, dataset, seed or schedule;
        one at the end of this fit's last epoch is returned as the result, nothing
        trained).
        With the same replica count the resumed fit ends bit-identical to an
        uninterrupted one, from a phase boundary or from inside a phase. ``on_epoch``: a
        function of (epoch record, history), or a list of them, called on the driver after
        each epoch (:mod:`dataflow.callbacks`). ``keep_best``: an epoch metric's name (or a
        :class:`~dataflow.callbacks.KeepBest`): the weights of the epoch where it was best
        become ``result.best_model``, and ``best.pt`` in ``checkpoint_dir``."""
        _check_epochs(epochs, self.lr_decay)
        callbacks = check_callbacks(on_epoch, self.epoch_keys())
        best = as_keep_best(keep_best, self.epoch_keys())
        _check_checkpoint_every(checkpoint_every, checkpoint_dir)
        store, checkpoint = self._open_checkpoints(checkpoint_dir, resume, keep_checkpoints, epochs)
        if checkpoint is not None:  # a job requeued after its fit ended: its result
            from dataflow.driver.finished import finished_result, is_finished

            if is_finished(checkpoint, epochs, self.planner(epochs)):
                return finished_result(self, checkpoint, store, best)
        if self.schedule.max_batch() > self.source.num_samples:
            raise BatchSizeError(
                f"schedule asks for a global batch of {self.schedule.max_batch()} but the "
                f"dataset has {self.source.num_samples} samples; use a batch size <= "
                f"{self.source.num_samples}"
            )
        self.graph.validate(replicas=self.config.replicas or 1)
        if self.config.capture and (blocker := self.graph.capture_blocker()) is not None:
            raise ConfigError(f"capture=True: {blocker}; use capture=False with this graph")
        if self.config.dry_run:
            self._dry_run()
        for stage in self.graph:  # a missing held-out chunk named now, not after an epoch
            if stage.kind == kinds.EVALUATE and getattr(stage, "source", None) is not None:
                check_held_out_chunks(stage.source)
        with (
            client_or_local_cluster(
                client,
                device=self.config.device,
                needed=(self.config.replicas or 1) * self.config.spatial,
                announce=self.config.progress,
            ) as active,
            # Dask's default-client lookups (distributed.wait) find the fit's client: one
            # connected to an address or a cluster object is not Dask's default
            active.as_current(),
        ):
            requested = self.config.layout
            layout, weighed = self._layout(active, epochs)
            check_transforms(self.graph, layout)
            if self.config.settles_at_window_end and layout is not None and layout.spatial > 1:
                raise ConfigError(
                    f"layout='auto' chose {layout.describe()}, which sync="
                    f"{type(self.config.sync).__name__} cannot run "
                    "(a group sums its gradient every step); give layout=None"
                )
            self.config.layout = layout
            try:
                result = run_fit(
                    self,
                    active,
                    epochs,
                    store=store,
                    checkpoint=checkpoint,
                    every=checkpoint_every,
                    on_epoch=callbacks,
                    keep_best=best,
                )
            finally:
                self.config.layout = requested
        if weighed:
            result.history.info["layout_candidates"] = [p.to_dict() for p in weighed]
        result.history.info["sync"] = self.config.sync.describe()
        return result

    def _layout_table(self, workers: int, epochs: int) -> tuple[str, int]:
        """The layout on ``workers`` and the candidates the layout model weighed."""
        from dataflow.costmodel.layout_cost import format_table
        from dataflow.planning.layout_choice import resolve

        layout, weighed = resolve(self, workers, epochs)
        chosen = layout.describe() if layout is not None else "sample parallel"
        table = "\n".join("    " + line for line in format_table(weighed).splitlines())
        text = f"{chosen} (the layout model's candidates, best first:)\n{table}"
        return text, layout.spatial if layout is not None else 1

    def _layout(self, client: Any, epochs: int) -> tuple[Any, list[Any]]:
        """The layout this fit runs (``layout="auto"``: the cost model's choice) and the
        candidates weighed, checked against ``memory_per_worker``."""
        config = self.config
        if config.layout != "auto" and config.memory_per_worker is None:
            return config.layout, []
        from dataflow.planning.layout_choice import resolve
        from dataflow.runtime.cluster import available_workers

        workers = len(available_workers(client))
        if config.replicas is not None:
            workers = min(workers, config.replicas * config.spatial)
        layout, weighed = resolve(self, workers, epochs)
        if config.progress and weighed:
            from dataflow.costmodel.layout_cost import format_table

            print(format_table(weighed))
        return layout, weighed

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
        progress = getattr(self.schedule, "counts_progress", False)  # epochs count that
        if checkpoint is not None and not progress and checkpoint.epoch > epochs:
            raise ConfigError(
                f"fit(epochs={epochs}, resume=True): the checkpoint in {directory} is already "
                f"at epoch {checkpoint.epoch}, past the {epochs} asked for; ask for at least "
                f"{checkpoint.epoch} epochs (that many: its result, nothing trained; more: "
                "training goes on)"
            )
        return store, checkpoint

    def _dry_run(self) -> None:
        """One step of two samples through the whole graph on the driver, no cluster.

        A factory that returns no module, a loss that is not a scalar, a transform
        that fails: each surfaces here, before any worker starts, with a plain traceback.
        Stages are shallow-copied, so what their setup stores never reaches the workers.
        It runs on the CPU whatever the fit's device: a CUDA error here would poison the
        driver's CUDA context and hide the message, and the driver's GPU, if it has one,
        may be a worker's. It learns which class labels are valid (``label_watch``): its
        own samples' labels are checked before the loss, and ``Load`` checks every batch's
        on the workers, on the host (torch's own check is a device-side assert on CUDA).
        """
        graph = self.graph.shallow_copy()
        order = graph.validate(replicas=1)
        size = min(2, self.source.num_samples)
        phase = PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=size)
        steps = phase_steps(num_samples=self.source.num_samples, phase=phase, split=lambda n: (n,))
        step = dataclasses.replace(steps[0], last_in_epoch=False)  # no end-of-epoch evaluation
        labels = watch_labels(graph, self.load, step, self.config.seed)
        spec = ReplicaSpec(
            run_id="dry-run", graph=graph, order=order, seed=self.config.seed, device="cpu"
        )
        spatial = None
        if self.config.spatial > 1:  # partition on the driver too: a layer it cannot is named
            from dataflow.runtime.spatial_rank import whole_sample

            spatial = whole_sample(self.config.layout, self.config.seed)
        runtime = ReplicaRuntime(spec, rank=0, world_size=1, collective=None, spatial=spatial)
        _warn_overlap_momentum(self.config.sync, runtime.context.optimizer)
        try:
            runtime.begin_phase(PhaseContext(index=0, steps=(step,), lr=None))
            runtime.run_window(step.index, step.index + 1)
        finally:
            runtime.close()
        self.load.labels = labels.for_workers()
        in_memory = getattr(self.source, "y", None)  # (an ArraySource: every label, now)
        if self.load.labels is not None and isinstance(in_memory, torch.Tensor):
            try:
                self.load.labels.check(in_memory, np.arange(len(in_memory)))
            except DataError as exc:
                exc.add_note("in the dry run: every label of the in-memory source, checked")
                raise


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


def _check_epochs(epochs: Any, lr_decay: LRDecay | None = None) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"fit(epochs={epochs!r}): epochs must be an int >= 1")
    if lr_decay is not None:
        lr_decay.check(epochs)


def _warn_overlap_momentum(sync: Any, optimizer: Any) -> None:
    """``Async(overlap=True)`` delays every gradient by a whole step, which adds to the
    optimizer's momentum ("asynchrony begets momentum"): on the digits, SGD momentum 0.9
    trained to 64 % with overlap and 99 % without; 0.5 trained to 96 %."""
    if not sync.overlap or optimizer is None:
        return
    momentum = optimizer.param_groups[0].get("momentum") or 0.0
    if momentum > 0.5:
        warnings.warn(
            f"sync.Async(overlap=True) with SGD momentum {momentum:g}: each gradient "
            "arrives a step late, which acts as extra momentum and trained badly on the "
            "digits at 0.9 (64 % against 99 % without overlap); lower the momentum to "
            "about 0.5 or drop overlap (docs/sync.md)",
            RuntimeWarning,
            stacklevel=4,
        )
