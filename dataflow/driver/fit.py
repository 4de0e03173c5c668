"""Start one fit: pick the workers, build the machine, executor, planner, recorder
and checkpoint writer, run the loop, and clean up on the workers whatever happens."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client


from dataflow.core import kinds
from dataflow.core.errors import ConfigError
from dataflow.core.precision import capture_simulated, cpu_fp16_allowed
from dataflow.driver.best_weights import BestWeights
from dataflow.driver.checkpoints import CheckpointWriter
from dataflow.driver.executor import Executor
from dataflow.driver.fit_settings import FitPlan, WorkerScaling, planned_model
from dataflow.driver.loop import FitLoop
from dataflow.driver.machine import FitMachine, MachineConfig
from dataflow.driver.recorder import Recorder
from dataflow.driver.stop_signals import StopSignals
from dataflow.history.result import FitResult
from dataflow.planning.layout import starting_workers, whole_replicas
from dataflow.runtime.cluster import available_workers, check_client
from dataflow.runtime.replica import ReplicaSpec
from dataflow.runtime.throttle import as_slowdown
from dataflow.stages.forward import build_model


def run_fit(
    trainer: Any,
    client: Client,
    epochs: int,
    *,
    store: Any,
    checkpoint: Any,
    every: int | None,
    on_epoch: tuple[Any, ...] = (),
    keep_best: Any = None,
) -> FitResult:
    """Train ``trainer``'s graph for ``epochs`` on ``client`` (see ``Trainer.fit``)."""
    config = trainer.config
    check_client(client)
    run_id = f"fit{uuid.uuid4().hex[:12]}"
    size = config.spatial
    workers = starting_workers(available_workers(client), config.replicas, size, config.max_workers)
    if config.min_workers > len(workers) // size:  # below its own floor from the start
        kind = "sample group(s)" if size > 1 else "replica(s)"
        raise ConfigError(
            f"min_workers={config.min_workers}, but the fit would start on "
            f"{len(workers) // size} {kind}, below the fewest it may go on with; start more "
            "workers (or wait for them: client.wait_for_workers(n)) or lower min_workers"
        )
    order = trainer.graph.validate(replicas=len(workers) // size)
    fit_plan = plan_from_cost_model(trainer, len(workers) // size, epochs)
    spec = ReplicaSpec(
        run_id=run_id,
        graph=trainer.graph,
        order=order,
        seed=config.seed,
        device=config.device,
        threads=config.threads_per_replica,
        collective_timeout_s=config.collective_timeout_s,
        relax_malloc=config.relax_malloc,
        freeze_gc=config.freeze_gc,
        pause_dask_profiler=config.pause_dask_profiler,
        throttle={int(r): as_slowdown(f) for r, f in config.throttle.items()},
        started_at=time.time(),
        commit_windows=config.recover_lost_workers,
        layout=config.layout if size > 1 else None,
        local=config.sync if config.local_updates else None,
        asynchronous=config.sync if config.asynchronous else None,
        precision=config.precision,
        channels_last=config.channels_last,
        compile=config.compile,
        allow_cpu_fp16=cpu_fp16_allowed(),
        capture=config.capture,
        simulate_capture=capture_simulated(),
        bucket_mb=fit_plan.bucket_mb,
        keep_average=keep_best is not None and keep_best.metric.startswith("eval_ema_"),
    )
    executor = Executor(client, spec)
    loop = build_loop(
        trainer,
        executor,
        epochs=epochs,
        order=order,
        run_id=run_id,
        store=store,
        every=every,
        fit_plan=fit_plan,
        on_epoch=on_epoch,
        keep_best=keep_best,
    )
    recorder = loop.recorder
    if checkpoint is not None:
        loop.restore_driver(checkpoint)
    info = recorder.history.info
    info.update(
        run_id=run_id,
        epochs=epochs,
        replicas=len(workers) // size,
        layout=config.layout.describe() if config.layout is not None else "sample parallel",
        seed=config.seed,
        stages=list(order),
        stage_kinds={name: type(trainer.graph[name]).__name__ for name in order},
        workers=[],
        dashboard=client.dashboard_link,
        regroups=[],
    )
    if checkpoint is not None:
        info["resumed_from"] = {
            "epoch": checkpoint.epoch,
            "step": checkpoint.step,
            "phase": checkpoint.phase_index,
        }
    started = time.perf_counter()
    failed = True
    loop.stop_signals = StopSignals(config.stop_signals)
    try:
        with loop.stop_signals:  # SIGTERM, SIGUSR1: save the commit, stop (FitStopped)
            state = loop.run(workers)
        # ema_decay: the weights' moving average, from rank 0 as its final weights
        average = executor.final_weights("averaged") if trainer.averages_weights else None
        if loop.best is not None and loop.best.info() is not None:  # (a resumed fit's too)
            info["best"] = loop.best.info()
        recorder.record_segments()  # info["segments"], train_seconds: every run's
        failed = False
    except BaseException as error:
        error.driver_log = loop.machine.log  # a failed fit's decisions replay too
        raise
    finally:
        recorder.close_bar()
        executor.close(failed=failed)
    info["fit_seconds"] = time.perf_counter() - started
    model = build_model(trainer.model_factory, config.seed)
    model.load_state_dict(state)
    result = FitResult(
        model=model,
        history=recorder.history,
        ledger=recorder.ledger,
        driver_log=loop.machine.log,
        best_model=best_model(trainer, loop.best),
        ema_model=averaged_model(trainer, average),
    )
    if config.progress:
        print(result.summary())
    return result


def build_loop(
    trainer: Any,
    executor: Any,
    *,
    epochs: int,
    order: tuple[str, ...],
    run_id: str = "",
    store: Any = None,
    every: int | None = None,
    fit_plan: FitPlan | None = None,
    on_epoch: tuple[Any, ...] = (),
    keep_best: Any = None,
) -> FitLoop:
    """The fit's machine, planner, recorder and checkpoint writer around ``executor``
    (Dask's, or :class:`~dataflow.driver.simulate.SimulatedExecutor`)."""
    config = trainer.config
    per_replica_caps = isinstance(config.max_micro_batch, tuple)
    if fit_plan is None:  # (a simulated executor's fit: planned on its workers)
        fit_plan = plan_from_cost_model(trainer, len(executor.available()), epochs)
    held_out = held_out_samples(trainer.graph)
    machine = FitMachine(
        MachineConfig(
            stage_names=order,
            run_id=run_id,
            window_seconds=fit_plan.window_seconds,
            window_steps=config.window_steps,
            min_workers=config.min_workers,
            recover_lost_workers=config.recover_lost_workers,
            restart_wait_s=config.restart_wait_s,
            restart_gather_s=config.restart_gather_s,
            max_restarts=config.max_restarts,
            max_stalls=config.max_stalls,
            roll_back_non_finite=trainer.rolls_back_non_finite,
            checkpoints=store is not None,
            checkpoint_every=every,
            may_join=config.elastic and not per_replica_caps,
            max_replicas=most_replicas(config),
            spatial=config.spatial,
            sync=config.sync,
            # a schedule counting progress ends the fit itself (no phase left)
            epochs=None if trainer.planner().counts_progress else epochs,
            epoch_review=bool(on_epoch),
            best_every=None if keep_best is None else trainer.metric_every(keep_best.metric),
            scaling=WorkerScaling.of(config, fit_plan.wire_scale)
            if config.scale_with_batch and config.elastic
            else None,
            held_out_samples=held_out,
        )
    )
    recorder = Recorder(
        graph=trainer.graph,
        order=order,
        load=trainer.load,
        seed=config.seed,
        skips_non_finite=trainer.skips_non_finite,
        progress=config.progress,
        cost_model=planned_model(config, fit_plan),
        lockstep_wait=config.settles_at_window_end,
        leases=bool(config.sync.leases),
        held_out_samples=held_out,
    )
    recorder.history.info["fit_plan"] = fit_plan.to_dict()
    writer = None if store is None else CheckpointWriter(store, trainer.checkpoint_fingerprint)
    loop = FitLoop(
        machine=machine,
        executor=executor,
        planner=trainer.planner(epochs),
        recorder=recorder,
        writer=writer,
        epochs=epochs,
        measures_noise=trainer.measures_noise,
        min_workers=config.min_workers,
        progress=config.progress,
        on_epoch=on_epoch,
        best=None if keep_best is None else keeper(trainer, keep_best, store, held_out),
    )
    return loop


def keeper(trainer: Any, rule: Any, store: Any, held_out: int | None) -> BestWeights:
    """The fit's keeper of its best epoch's weights; a resumed fit's earlier runs'
    best weights in ``store`` (a fresh fit cleared them) are the bar it must beat."""
    fingerprint = getattr(trainer, "checkpoint_fingerprint", None) if store else None
    best = BestWeights(rule, store, fingerprint, held_out)
    best.resume()
    return best


def averaged_model(trainer: Any, state: dict[str, Any] | None) -> Any:
    """``result.ema_model``: the weights' moving average in a fresh model, or None."""
    if state is None:
        return None
    model = build_model(trainer.model_factory, trainer.config.seed)
    model.load_state_dict(state)
    return model


def best_model(trainer: Any, best: BestWeights | None) -> Any:
    """``result.best_model``: the kept epoch's weights in a fresh model, or None."""
    weights = None if best is None else best.weights()
    if weights is None:
        return None
    model = build_model(trainer.model_factory, trainer.config.seed)
    model.load_state_dict(weights)
    return model


def most_replicas(config: Any) -> int | None:
    """The most replicas the fit may have at once, its first group and its joins alike:
    ``replicas`` when fixed, else as many whole replicas as ``max_workers`` holds (each
    is ``spatial`` workers; None: no limit)."""
    if config.replicas is not None or config.max_workers is None:
        return config.replicas
    return whole_replicas(config.max_workers, config.spatial)


def plan_from_cost_model(trainer: Any, replicas: int, epochs: int) -> FitPlan:
    """The window length and the bucket size for this fit (``driver/fit_settings.py``),
    planned for its first phase on the ``replicas`` it starts with. Pure: the planned
    bucket travels in the ReplicaSpec to the replicas (for AllReduce stages that left
    ``bucket_mb`` to the engine); the user's stages are not changed."""
    first = trainer.planner().next_phase(0, epochs, None)
    return trainer.fit_plan(trainer.config.replicas or max(1, replicas), first.global_batch)


def held_out_samples(graph: Any) -> int | None:
    """The samples the graph's evaluation scores each time (its Evaluate stage's source),
    or None without one."""
    for stage in graph:
        if stage.kind == kinds.EVALUATE and getattr(stage, "source", None) is not None:
            return int(stage.source.num_samples)
    return None
