"""How a fit runs (what it computes is the graph and the schedule): one typed config,
validated where it is built, each message naming the field and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.core.precision import (
    capture_simulated,
    check_capture,
    check_fp16_device,
    check_step_options,
    cpu_fp16_allowed,
)
from dataflow.schedule.balance import Balancer, Even


@dataclass(kw_only=True)
class TrainerConfig:
    """How a fit runs (what it computes is the graph and the schedule)."""

    seed: int = 0
    # default: every worker of the client, up to max_workers; the rest are spares that
    # replace a lost replica (elastic fits)
    replicas: int | None = None
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when the worker has one)
    threads_per_replica: int | None = None  # torch intra-op threads; default: the worker's
    # Work fused into one Dask task; default: from cost_model (the window that keeps
    # the engine's per-window cost near 1 %), else 1 s.
    window_seconds: float | None = None
    # Fixed steps per window instead (no timing): for reproducible window boundaries,
    # e.g. a mid-phase checkpoint every N steps with checkpoint_every.
    window_steps: int | None = None
    # A collective that waits longer fails (a peer died or hangs); the driver also
    # watches the workers, so a lost worker is usually noticed within a second or two.
    collective_timeout_s: float = 30.0
    # Keep training when workers die: survivors roll back to the last window every
    # replica finished and go on; below min_workers the fit stops with WorkerLostError.
    recover_lost_workers: bool = True
    min_workers: int = 1
    # Every replica lost at once (a node, a job of a batch system): how long the fit waits
    # for min_workers to come back (dask-jobqueue's adapt starting jobs again, a nanny
    # restarting its worker) before failing, then how long more for as many as it had.
    restart_wait_s: float = 60.0
    restart_gather_s: float = 10.0
    # How often the fit starts again from one checkpoint when every replica is lost before
    # the next one is written (a node that keeps failing: torchrun's --max-restarts), and
    # how often a phase is redone after a collective timed out on a live but slow peer
    # before that replica is dropped (or the fit stops, naming collective_timeout_s).
    max_restarts: int = 3
    max_stalls: int = 3
    relax_malloc: bool = True  # undo Dask's MALLOC_TRIM_THRESHOLD_ in replica workers
    freeze_gc: bool = True  # gc.freeze() the workers' long-lived objects after setup
    pause_dask_profiler: bool = True  # no 10 ms stack sampling of replica workers while fitting
    balancer: Balancer = field(default_factory=Even)
    # Memory cap: the most samples one replica's forward/backward holds; a larger local
    # batch is run as micro-batches with gradient accumulation. One int, or one per replica.
    max_micro_batch: int | tuple[int, ...] | None = None
    # rank -> simulated slow-down: a factor, or a schedule of factors over wall time
    throttle: dict[int, Any] = field(default_factory=dict)
    # With replicas=None, workers that joined the client are used from the next phase.
    elastic: bool = True
    # Ask the cluster for more workers (up to max_workers) when a phase's batch per
    # replica would exceed max_micro_batch; LocalCluster, dask-jobqueue, any cluster.scale.
    scale_with_batch: bool = False
    max_workers: int | None = None
    scale_timeout_s: float = 120.0  # how long to wait for requested workers to arrive
    # A dataflow.costmodel.CostModel (calibrated or from a preset): each phase's history
    # holds its prediction next to the measurement, and it plans the worker count
    # (scale_with_batch, by goodput), the window length and the bucket size.
    cost_model: Any = None
    # How workers form replicas: dataflow.Layout(spatial=P) splits each sample's spatial
    # dimensions over P workers (a replica is then a group of P workers); None: one
    # worker per replica (sample parallelism).
    layout: Any = None
    # A worker's memory for one replica's training (bytes, or "2GiB"): a layout whose
    # samples need more is refused, naming the smallest spatial split that fits;
    # layout="auto" picks the layout the cost model predicts fastest under it.
    memory_per_worker: int | str | None = None
    # How replicas keep their weights in step: dataflow.sync.Synchronous() (every step)
    # or dataflow.sync.Local(period_seconds=...) (local steps, then a weighted average).
    sync: Any = None
    # How a step computes on its device (dataflow.core.precision): autocast dtype
    # ("auto": bf16 on a GPU that supports it, fp32 on the CPU), the memory format of
    # model and batches ("auto": channels_last on CUDA for 2-D/3-D conv models), and
    # torch.compile of the model (False: eager). Parameters and the allreduce stay fp32.
    precision: str = "auto"
    channels_last: bool | str = "auto"
    compile: bool | str = False
    # Replay each steady step's forward, loss and backward as a CUDA graph (one per input
    # shape; the optimizer and the allreduce stay eager): the GPU no longer waits for
    # Python to launch the step's kernels (stages/capture.py; README, "On GPUs").
    capture: bool = False
    progress: bool = True
    dry_run: bool = True  # one tiny step on the driver first, for early clear errors
    # Signals to the driver process that stop the fit cleanly: what every replica
    # committed is saved as a checkpoint (with checkpoint_dir) and the fit raises
    # FitStopped, so the same command with resume=True goes on (a batch system's notice
    # before a wall-clock limit or a preemption: SLURM's --signal=USR1@120). () : none.
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")

    @property
    def spatial(self) -> int:
        """Workers per replica (``layout.spatial``; 1 without a layout)."""
        return getattr(self.layout, "spatial", 1)

    @property
    def local_updates(self) -> bool:
        from dataflow.sync import Local

        return isinstance(self.sync, Local)

    @property
    def asynchronous(self) -> bool:
        from dataflow.sync import Async

        return isinstance(self.sync, Async)

    @property
    def settles_at_window_end(self) -> bool:
        """Local or asynchronous updates: replicas share weights only at window ends."""
        return self.sync.ends_windows_at_epochs

    def _check_sync(self) -> None:
        """A ``Local`` period is one window: it sets the window length."""
        from dataflow.sync import Async, Local, Synchronous, SyncPolicy

        if self.sync is None:
            self.sync = Synchronous()
        if not isinstance(self.sync, SyncPolicy):
            raise ConfigError(
                f"sync={self.sync!r}: give dataflow.sync.Synchronous(), "
                "dataflow.sync.Async(staleness=...) or dataflow.sync.Local(period_seconds=...)"
            )
        if isinstance(self.sync, Async) and self.spatial > 1:
            raise ConfigError(
                "sync=Async with a spatial layout: a group's workers must sum their parts of "
                "the gradient before it is pushed; use sync=Synchronous() with layout=, or "
                "layout=None"
            )
        if not isinstance(self.sync, Local):
            return
        if self.sync.period_samples is not None and (self.window_steps or self.window_seconds):
            name = "window_steps" if self.window_steps else "window_seconds"
            raise ConfigError(
                f"{name}={getattr(self, name)} and sync=Local(period_samples="
                f"{self.sync.period_samples}): a local-update period is one window; drop {name}"
            )
        given = {"window_steps": self.sync.period_steps, "window_seconds": self.sync.period_seconds}
        for name, value in given.items():
            mine = getattr(self, name)
            if value is not None and mine is not None and mine != value:
                raise ConfigError(
                    f"{name}={mine} and sync=Local(period_{name.split('_')[1]}={value}): a "
                    f"local-update period is one window; drop {name}"
                )
            if value is not None:
                setattr(self, name, value)
        if self.spatial > 1:
            raise ConfigError(
                "sync=Local with a spatial layout: a group's workers must sum their parts of "
                "the gradient every step; use sync=Synchronous() with layout=, or layout=None"
            )

    def __post_init__(self) -> None:
        self._check_sync()
        check_step_options(self.precision, self.channels_last, self.compile)
        if self.compile and self.spatial > 1:
            raise ConfigError(
                f"compile={self.compile!r} with a spatial layout: the partitioned model "
                "exchanges halos between workers inside its forward, which torch.compile "
                "cannot trace; use compile=False with layout=, or layout=None"
            )
        if self.precision == "fp16" and (self.settles_at_window_end or self.spatial > 1):
            what = "a spatial layout" if self.spatial > 1 else f"sync={type(self.sync).__name__}"
            raise ConfigError(
                f"precision='fp16' with {what}: its loss scale is decided each step from the "
                "allreduced gradient, which only synchronous sample-parallel training has; "
                "use precision='bf16' (no loss scale needed) or 'fp32'"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ConfigError(f"replicas must be an int >= 1 or None, got {self.replicas!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        check_fp16_device(self.precision, self.device, allowed=cpu_fp16_allowed())
        check_capture(
            self.capture,
            precision=self.precision,
            compile=self.compile,
            device=self.device,
            spatial=self.spatial,
            simulate=capture_simulated(),
        )
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ConfigError(f"threads_per_replica must be >= 1, got {self.threads_per_replica}")
        for name in (
            "window_seconds",
            "collective_timeout_s",
            "scale_timeout_s",
            "restart_wait_s",
            "restart_gather_s",
        ):
            value = getattr(self, name)
            if name == "window_seconds" and value is None:
                continue
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
        if self.window_steps is not None and (
            isinstance(self.window_steps, bool)
            or not isinstance(self.window_steps, int)
            or self.window_steps < 1
        ):
            raise ConfigError(
                f"window_steps must be an int >= 1 (steps fused into one Dask task) or None "
                f"(fuse about window_seconds of work), got {self.window_steps!r}"
            )
        if self.window_seconds is not None and not self.window_seconds > 0:
            raise ConfigError(
                f"window_seconds must be > 0 (seconds of work per Dask task), got "
                f"{self.window_seconds}"
            )
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if not self.restart_wait_s > 0 or self.restart_gather_s < 0:
            raise ConfigError(
                f"restart_wait_s={self.restart_wait_s}, restart_gather_s={self.restart_gather_s}: "
                "seconds the fit waits for workers when every replica is lost (> 0), then for "
                "as many as it had (>= 0)"
            )
        for name, what in (
            (
                "max_restarts",
                "times the fit starts again from one checkpoint when every replica is lost",
            ),
            ("max_stalls", "redos of a phase after a collective timed out on a live peer"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0 ({what}; 0: none), got {value!r}")
        self.stop_signals = _stop_signals(self.stop_signals)
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
            isinstance(r, bool) or not isinstance(r, int) or r < 0 or not _slows(f)
            for r, f in self.throttle.items()
        ):
            raise ConfigError(
                f"throttle={self.throttle!r}: give {{rank: factor}} with factors >= 1, e.g. "
                "{1: 2.0} to make replica 1 take twice its compute time (a simulated slow node), "
                "or a moving one: {1: dfl.SlowdownSchedule.alternating(1.0, 3.0, every_s=3.0)} "
                "or {1: dfl.NoisyNeighbour(seed=0)}"
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
        if self.max_workers is not None and self.max_workers < self.spatial:
            raise ConfigError(
                f"max_workers={self.max_workers} is fewer than the {self.spatial} workers one "
                f"replica of Layout(spatial={self.spatial}) needs; max_workers counts workers "
                f"(here {self.spatial} per replica): set it to at least {self.spatial}"
            )
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
        if self.cost_model is not None:
            from dataflow.costmodel import CostModel

            if not isinstance(self.cost_model, CostModel):
                raise ConfigError(
                    f"cost_model must be a dataflow.costmodel.CostModel (from "
                    f"dataflow.costmodel.calibrate(pipe, client) or a preset), got "
                    f"{type(self.cost_model).__name__}"
                )
        if self.layout is not None:
            from dataflow.planning.layout import Layout

            if not isinstance(self.layout, Layout) and self.layout != "auto":
                raise ConfigError(
                    f"layout must be a dataflow.Layout, e.g. dataflow.Layout(spatial=2) to split "
                    f"each sample over 2 workers, or 'auto' (the cost model chooses), got "
                    f"{type(self.layout).__name__} {self.layout!r}"
                )
        from dataflow.planning.layout_choice import parse_bytes

        parse_bytes(self.memory_per_worker)
        if isinstance(self.balancer, str | bytes) or not isinstance(self.balancer, Balancer):
            raise ConfigError(
                "balancer must be a balancer object such as dfl.balance.Throughput() or "
                f"dfl.balance.Even() (import dataflow as dfl), got "
                f"{type(self.balancer).__name__} {self.balancer!r}"
            )


def check_options(options: dict[str, Any], own: Sequence[str] = (), caller: str = "") -> None:
    """Unknown options are named, with the closest valid one (a typo is the usual cause).
    ``own``: the caller's own parameters (``Pipeline``'s), valid too and listed first."""
    fields = [f.name for f in dataclasses.fields(TrainerConfig)]
    valid = [*own, *(name for name in fields if name not in own)]
    for name, value in options.items():
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lists = (
                f"{caller}'s own: {', '.join(own)}; and how the fit runs: {', '.join(fields)}"
                if own
                else ", ".join(fields)
            )
            raise ConfigError(f"unknown option {name}={value!r}{hint}. Valid options: {lists}")


def _slows(value: Any) -> bool:
    """A throttle value: a factor >= 1, or a slow-down schedule."""
    from dataflow.runtime.throttle import as_slowdown

    try:
        as_slowdown(value)
    except (ConfigError, TypeError, ValueError):
        return False
    return True


# Signals a fit may not take as its stop: SIGKILL and SIGSTOP cannot be caught, and
# Ctrl-C (SIGINT) has its own prompt stop (dataflow.runtime.interrupt)
_UNCATCHABLE = ("SIGKILL", "SIGSTOP", "SIGINT")


def _stop_signals(names: Any) -> tuple[str, ...]:
    """``stop_signals`` as given: names of catchable signals (``"SIGTERM"``, ``"USR1"``)."""
    import signal

    if isinstance(names, str):
        names = (names,)
    given = tuple(names) if isinstance(names, list | tuple) else None
    out = []
    for name in given or ():
        full = name if isinstance(name, str) and name.startswith("SIG") else f"SIG{name}"
        if not isinstance(name, str) or not hasattr(signal, full) or full in _UNCATCHABLE:
            given = None
            break
        out.append(full)
    if given is None:
        raise ConfigError(
            f"stop_signals={names!r}: give the names of signals that stop the fit after "
            "saving its commit, e.g. ('SIGTERM', 'SIGUSR1') (the default), or () for none; "
            "not SIGKILL or SIGSTOP (they cannot be caught) nor SIGINT (Ctrl-C stops a "
            "fit at once)"
        )
    return tuple(out)
