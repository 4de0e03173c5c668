"""Shared pieces of the benchmarks: the CNN, the data, the hand-written loop, JSON output.

Everything here is importable from a spawned process (hand loop, DDP ranks) and is
pickled by value to Dask workers (see :func:`ship_to_workers`), so the benchmarks
run from a plain checkout without installing this folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dataflow.runtime.malloc import relax_malloc as relax_malloc
from dataflow.tools.cpu_meter import CpuMeter as CpuMeter

RESULTS = Path(__file__).resolve().parent / "results"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))

# The examples' models, not copies: what a user runs is what is measured.
import cosmoflow  # noqa: E402
import digits  # noqa: E402
from cosmoflow import CosmoNet as CosmoNet  # noqa: E402
from digits import DigitsNet as DigitsNet  # noqa: E402

# -- model and data ---------------------------------------------------------------------


@dataclass(frozen=True)
class CNNConfig:
    """A plain conv net: ``[conv3x3 -> ReLU (-> conv3x3 -> ReLU)] -> maxpool`` per stage."""

    in_channels: int = 3
    image: int = 32
    channels: tuple[int, ...] = (16, 32)
    convs_per_stage: int = 1
    hidden: int = 64
    classes: int = 10


class CNN(torch.nn.Module):
    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        c, size = config.in_channels, config.image
        for width in config.channels:
            for _ in range(config.convs_per_stage):
                layers += [torch.nn.Conv2d(c, width, 3, padding=1), torch.nn.ReLU()]
                c = width
            layers.append(torch.nn.MaxPool2d(2))
            size //= 2
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(c * size * size, config.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(config.hidden, config.classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@dataclass(frozen=True)
class ModelFactory:
    """A picklable ``() -> CNN`` (what ``Pipeline(model=...)`` calls once per replica)."""

    config: CNNConfig

    def __call__(self) -> CNN:
        return CNN(self.config)


def parameter_count(config: CNNConfig) -> int:
    return sum(p.numel() for p in CNN(config).parameters())


def make_data(n: int, config: CNNConfig, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic images and labels, deterministic in ``seed`` (regenerated in each process)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, config.in_channels, config.image, config.image), dtype=np.float32)
    y = rng.integers(0, config.classes, size=n).astype(np.int64)
    return x, y


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 0.01
    momentum: float = 0.9


@dataclass(frozen=True)
class OptimizerFactory:
    """Picklable ``params -> SGD(momentum)``, the same for dataflow and the baselines."""

    config: OptimConfig

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.config.lr, momentum=self.config.momentum)


def ship_to_workers() -> None:
    """Pickle this module and the examples' (whose models the benchmarks train) by
    value, so Dask workers need not import them."""
    import cloudpickle

    for module in (sys.modules[__name__], cosmoflow, digits):
        cloudpickle.register_pickle_by_value(module)


class SignalNet(torch.nn.Module):
    """Three 1D conv stages, global average pooling, a linear head (6 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv1d(1, 16, 7, padding=3),
            torch.nn.ReLU(),
            torch.nn.MaxPool1d(2),
            torch.nn.Conv1d(16, 32, 5, padding=2),
            torch.nn.ReLU(),
            torch.nn.MaxPool1d(2),
            torch.nn.Conv1d(32, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool1d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(32, 6),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class TargetMSE:
    """The held-out MSE of one regression target (column ``j``), an eval metric (in
    fp32 whatever the output's precision)."""

    j: int

    def __call__(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((output[:, self.j].float() - y[:, self.j]) ** 2).mean()


@dataclass(frozen=True)
class Optimizer:
    """Picklable ``params -> SGD(lr, momentum 0.9)`` or ``Adam(lr)``."""

    kind: str
    lr: float

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.Adam(params, lr=self.lr)


# -- the hand-written baseline ---------------------------------------------------------


@dataclass
class Workload:
    """What both sides train: model, data, global batch, epochs, seed, optimizer."""

    model: CNNConfig
    samples: int
    batch: int
    epochs: int
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.samples / self.batch)

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs


def timed_steps(
    model: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor, batches: list, pick: Any
) -> dict[str, Any]:
    """The plain training loop both baselines run, timed per step.

    ``pick(parts)`` gives a step's sample indices from each replica's parts. Per step:
    index the tensors (timed as ``load``), forward, loss, backward, ``step()``,
    ``zero_grad(set_to_none=True)``; ``ends[i]``: end of step ``i`` since the start.
    """
    loads, seconds, ends, losses, samples = [], [], [], [], []
    started = time.perf_counter()
    for parts in batches:
        t0 = time.perf_counter()
        index = pick(parts)
        xb, yb = x.index_select(0, index), y.index_select(0, index)
        t1 = time.perf_counter()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        losses.append(loss.detach())
        loads.append(t1 - t0)
        seconds.append(t2 - t0)
        ends.append(t2 - started)
        samples.append(sum(len(part) for part in parts))
    return {
        "started": started,
        "loads": loads,
        "seconds": seconds,
        "ends": ends,
        "losses": losses,
        "samples": samples,
    }


def planned_batches(work: Workload, replicas: int) -> list[list[torch.Tensor]]:
    """Per step, each replica's sample indices, exactly as a dataflow fit reads them."""
    from dataflow.io import replica_streams
    from dataflow.planning.plan import phase_steps
    from dataflow.schedule import PhaseSpec
    from dataflow.schedule.balance import Even

    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=work.epochs, global_batch=work.batch)
    steps = phase_steps(
        num_samples=work.samples, phase=phase, split=lambda n: Even().split(n, replicas)
    )
    streams = replica_streams(steps, num_samples=work.samples, seed=work.seed)
    return [[torch.from_numpy(part) for part in parts] for _, parts in streams]


def hand_loop(work: Workload, threads: int, relax: bool = False) -> dict[str, Any]:
    """The plain torch loop (:func:`timed_steps`) over exactly the batches a dataflow
    fit visits. ``relax``: call :func:`relax_malloc` first."""
    if relax:
        relax_malloc()
    torch.set_num_threads(threads)
    batches = planned_batches(work, replicas=1)
    x_np, y_np = make_data(work.samples, work.model, work.seed)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    torch.manual_seed(work.seed)  # what dataflow's build_model does before the factory
    model = ModelFactory(work.model)().train()
    optimizer = OptimizerFactory(work.optim)(model.parameters())
    steps = timed_steps(model, optimizer, x, y, batches, torch.cat)
    return {
        "torch_threads": torch.get_num_threads(),
        "total_seconds": time.perf_counter() - steps["started"],
        "load_seconds": steps["loads"],
        "step_seconds": steps["seconds"],
        "ends": steps["ends"],
        "losses": torch.stack(steps["losses"]).tolist(),
    }


def _child(fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


# The environment this process started with. Starting a LocalCluster writes the Nanny's
# ``distributed.nanny.pre-spawn-environ`` (MALLOC_TRIM_THRESHOLD_, OMP_NUM_THREADS ...)
# into ``os.environ`` of the driver, which later spawned baselines would inherit.
START_ENV = dict(os.environ)


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is exactly ``env`` inside the block (for what is spawned there)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def in_subprocess(fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Any:
    """``fn(*args)`` in a fresh spawned process, in :data:`START_ENV` plus ``env``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with environment({**START_ENV, **(env or {})}):
        process = ctx.Process(target=_child, args=(fn, args, queue))
        process.start()
    status, value = queue.get()
    process.join()
    if status != "ok":
        raise RuntimeError(f"subprocess failed:\n{value}")
    return value


SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


# -- measuring a fit -------------------------------------------------------------------


def window_ends(steps: Sequence[dict[str, Any]]) -> list[int]:
    """Positions of the last step of each window in ``history.steps``.

    The driver records all steps of a window at once (microseconds apart); windows
    are separated by at least a step's compute time.
    """
    gap = 0.25 * min(s["seconds"] for s in steps)
    ends = [i for i in range(len(steps) - 1) if steps[i + 1]["time"] - steps[i]["time"] > gap]
    return [*ends, len(steps) - 1]


def steady_boundary(steps: Sequence[dict[str, Any]], warmup: int) -> int:
    """The first step counted as steady: the first window start at or after ``warmup``,
    else the last window start (windows grow as the driver calibrates, so a short run
    may hold one long window after the warm-up ones)."""
    starts = [end + 1 for end in window_ends(steps)[:-1]]
    if not starts:
        raise ValueError("the run is one window: run more steps to time a steady state")
    return next((s for s in starts if s >= warmup), starts[-1])


@dataclass
class Steady:
    """Steps ``[first, last]`` of a run, timed from the end of step ``first - 1``."""

    first: int
    steps: int
    samples: int
    seconds: float

    @property
    def seconds_per_sample(self) -> float:
        return self.seconds / self.samples

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds


def steady_fit(steps: Sequence[dict[str, Any]], first: int) -> Steady:
    """Driver wall time from the arrival of window ending at ``first - 1`` to the last one."""
    counted = steps[first:]
    return Steady(
        first=first,
        steps=len(counted),
        samples=sum(s["samples"] for s in counted),
        seconds=steps[-1]["time"] - steps[first - 1]["time"],
    )


def steady_loop(ends: Sequence[float], samples_per_step: Sequence[int], first: int) -> Steady:
    return Steady(
        first=first,
        steps=len(ends) - first,
        samples=sum(samples_per_step[first:]),
        seconds=ends[-1] - ends[first - 1],
    )


def scheduling_share(phase: dict[str, Any], replica: int = 0) -> float:
    """Share of the phase's wall time on the driver not spent inside window tasks."""
    return 1.0 - phase["task_seconds"][replica] / phase["seconds"]


def task_gaps(records: Sequence[dict[str, Any]], replica: int) -> dict[str, Any]:
    """Idle gaps of one replica's worker between its tasks, from Dask's task stream.

    ``train->train`` gaps: from the end of a fused window to the start of the next one
    (one scheduler round trip, as each window depends on the previous one); the other
    gaps are fixed per phase (begin-phase, calibration hand-over through the driver,
    end-phase). ``sum_compute_seconds``: Dask's compute time per task kind (for windows,
    compare with ``task_seconds``, timed inside the task function); ``span_seconds``:
    first task start to last task stop on this worker.
    """
    tag = f"@replica{replica}-"
    tasks = sorted(
        (s["start"], s["stop"], r["key"] if isinstance(r["key"], str) else str(r["key"]))
        for r in records
        if tag in str(r["key"]) and not str(r["key"]).startswith(("setup@", "weights@"))
        for s in r["startstops"]
        if s["action"] == "compute"
    )
    kinds = []
    for _, _, key in tasks:
        kind = key.split("@", 1)[0]
        if "-train-" in key or "-calibrate-" in key:
            kind = "train" if "-train-" in key else "calibrate"
        kinds.append(kind)
    gaps: dict[str, list[float]] = {}
    for i in range(1, len(tasks)):
        name = f"{kinds[i - 1]}->{kinds[i]}"
        gaps.setdefault(name, []).append(tasks[i][0] - tasks[i - 1][1])
    train = gaps.get("train->train", [])
    compute: dict[str, float] = {}
    for (start, stop, _), kind in zip(tasks, kinds, strict=True):
        compute[kind] = compute.get(kind, 0.0) + (stop - start)
    return {
        "tasks": len(tasks),
        "span_seconds": (tasks[-1][1] - tasks[0][0]) if tasks else float("nan"),
        "sum_compute_seconds": compute,
        "median_train_window_gap_seconds": median(train),
        "max_train_window_gap_seconds": max(train) if train else float("nan"),
        "sum_gaps_seconds": {k: sum(v) for k, v in gaps.items()},
        "count_gaps": {k: len(v) for k, v in gaps.items()},
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_fit(
    work: Workload,
    *,
    replicas: int,
    window_seconds: float,
    malloc_trim: str = "dask-default",
    bucket_mb: float = 25.0,
    worker_profile: bool = True,
    pin: bool = False,
    engine_relax_malloc: bool = True,
    gc_freeze: bool = False,
) -> dict[str, Any]:
    """``Pipeline.fit`` on a LocalCluster of ``replicas`` single-threaded worker processes.

    The cluster is started (and its workers awaited) before the fit and closed after,
    so its start-up is not in any figure. ``malloc_trim``: ``"dask-default"`` is what
    users get; ``"unset"`` drops the ``MALLOC_TRIM_THRESHOLD_=65536`` that Dask's Nanny
    puts in the workers' environment; ``"mallopt"`` keeps it but calls
    :func:`relax_malloc` in each worker before the fit (the in-process remedy).
    ``worker_profile=False`` turns off the Dask workers' statistical profiler (a thread
    that samples the task thread's Python stack every 10 ms). ``pin``: worker ``i`` (in
    rank order) and all its threads on core ``i`` (diagnosis).
    ``engine_relax_malloc=False``: ``Pipeline(relax_malloc=False)``, the engine does not
    undo ``MALLOC_TRIM_THRESHOLD_`` (engines before that option: the only behaviour).
    ``gc_freeze``: import torch and dataflow in each worker, then ``gc.collect()`` and
    ``gc.freeze()`` before the fit (diagnosis). Full garbage collections in the workers
    are timed in every case (:func:`install_gc_probe`).
    """
    import dask
    from distributed import Client, LocalCluster, get_task_stream

    import dataflow

    ship_to_workers()
    x, y = make_data(work.samples, work.model, work.seed)
    options: dict[str, Any] = {}
    if "relax_malloc" in {f.name for f in dataclasses.fields(dataflow.TrainerConfig)}:
        options["relax_malloc"] = engine_relax_malloc
    elif not engine_relax_malloc:
        raise SystemExit("this dataflow has no relax_malloc option (it never relaxes malloc)")
    pipe = dataflow.Pipeline(
        model=ModelFactory(work.model),
        loss=F.cross_entropy,
        optimizer=OptimizerFactory(work.optim),
        source=dataflow.io.ArraySource(x, y, shuffle=True),
        schedule=dataflow.schedule.Fixed(work.batch),
        seed=work.seed,
        progress=False,
        threads_per_replica=1,
        window_seconds=window_seconds,
        replicas=replicas,
        bucket_mb=bucket_mb,
        **options,
    )
    config: dict[str, Any] = {}
    if malloc_trim == "unset":
        config["distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"] = None
    if not worker_profile:
        config["distributed.worker.profile.enabled"] = False
    with (
        dask.config.set(config),
        environment(START_ENV),
        LocalCluster(
            n_workers=replicas,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(replicas)
        if malloc_trim == "mallopt":
            client.run(relax_malloc)
        if pin:  # worker i (in dataflow's rank order) on core i
            from dataflow.runtime.cluster import live_workers

            workers = live_workers(client)
            order = sorted(workers, key=lambda a: (workers[a].get("host", ""), a))
            for rank, address in enumerate(order):
                client.run(pin_process, rank, workers=[address])
        if gc_freeze:
            client.run(freeze_gc)
        worker_env = client.run(_malloc_env)
        client.run(install_gc_probe)
        started = time.perf_counter()
        with get_task_stream(client) as stream:
            result = pipe.fit(epochs=work.epochs, client=client)
        wall = time.perf_counter() - started
        gc_pauses = client.run(read_gc_probe)
    relaxed = {str(w.get("malloc_relaxed")) for w in result.history.info["workers"]}
    return {
        "history": result.history.to_dict(),
        "fit_call_seconds": wall,
        "gaps": [task_gaps(stream.data, r) for r in range(replicas)],
        "worker_env": [*sorted(set(worker_env.values())), f"engine malloc_relaxed={relaxed}"],
        "worker_gc": list(gc_pauses.values()),
    }


def install_gc_probe(dask_worker: Any = None) -> int:
    """Time every garbage collection of this worker process (kept on the worker object)."""
    import gc

    events: list[tuple[int, float, str]] = []
    started: dict[str, float] = {}

    def probe(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            name = threading.current_thread().name
            events.append((info["generation"], time.perf_counter() - started["t"], name))

    previous = getattr(dask_worker, "_bench_gc_probe", None)
    if previous in gc.callbacks:
        gc.callbacks.remove(previous)
    gc.callbacks.append(probe)
    dask_worker._bench_gc_probe, dask_worker._bench_gc_events = probe, events
    return len(gc.get_objects())


def read_gc_probe(dask_worker: Any = None) -> dict[str, Any]:
    """Full (generation 2) collections since :func:`install_gc_probe`, and their pauses."""
    import gc

    events = getattr(dask_worker, "_bench_gc_events", [])
    full = [(seconds, thread) for generation, seconds, thread in events if generation == 2]
    young = [seconds for generation, seconds, _ in events if generation < 2]
    return {
        "objects": len(gc.get_objects()),
        "frozen": gc.get_freeze_count(),
        "full_collections": len(full),
        "full_seconds": sum(s for s, _ in full),
        "full_max_seconds": max((s for s, _ in full), default=0.0),
        "full_threads": sorted({t for _, t in full}),
        "young_collections": len(young),
        "young_seconds": sum(young),
    }


def freeze_gc() -> int:
    """What a replica's setup imports, then move every object out of the collector's way."""
    import gc

    import torch.nn.functional  # noqa: F401

    import dataflow.runtime.replica  # noqa: F401

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def print_gc(fit: dict[str, Any]) -> None:
    parts = [
        f"{g['full_collections']} full, {g['full_seconds'] * 1e3:.0f} ms "
        f"(max {g['full_max_seconds'] * 1e3:.0f} ms, {g['objects']} objects, "
        f"{g['frozen']} frozen)"
        for g in fit["worker_gc"]
    ]
    print("worker garbage collections during the fit: " + "; ".join(parts))


def pin_process(core: int) -> int:
    """Pin every thread of this process (and threads it starts later) to one core."""
    cores = sorted(os.sched_getaffinity(0))
    target = {cores[core % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), target)
    return next(iter(target))


def _malloc_env() -> str:
    return f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_')}"


def _sample_busy(seconds: float) -> float:
    """Cores kept busy by other programs over ``seconds`` (this process sleeping)."""
    with CpuMeter() as meter:
        time.sleep(seconds)
    return meter.foreign_cpu_seconds / meter.wall_seconds


def wait_quiet(max_wait: float, *, cores: float = 0.15, sample: float = 2.0) -> float:
    """Wait (up to ``max_wait`` s) until other programs use < ``cores`` cores; returns it."""
    deadline = time.monotonic() + max_wait
    while True:
        load = _sample_busy(sample)
        if load < cores or time.monotonic() >= deadline:
            return load
        print(f"    machine busy ({load:.2f} cores used by others); waiting ...", flush=True)


def measure_side(
    name: str, fn: Callable[[], Any], *, retries: int, max_wait: float, max_foreign: float
) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` when the machine is quiet; rerun it if others used CPU meanwhile.

    ``max_foreign``: cores used by other programs, averaged over the run, above which
    the run is considered disturbed. The last attempt is kept in any case, flagged.
    """
    attempts = []
    for attempt in range(retries + 1):
        before = wait_quiet(max_wait)
        print(f"  running {name} (attempt {attempt + 1}) ...", flush=True)
        with CpuMeter() as meter:
            value = fn()
        foreign = meter.foreign_cpu_seconds / meter.wall_seconds
        attempts.append(
            {
                **meter.as_dict(),
                "foreign_cores": foreign,
                "idle_before": before,
                "steady_threads": meter.threads_between(*STEADY_SPAN),
            }
        )
        if foreign <= max_foreign:
            break
        print(f"    disturbed: other programs used {foreign:.2f} cores meanwhile", flush=True)
    return value, {"attempts": attempts, "disturbed": foreign > max_foreign}


# The part of a side's wall time (start, stop as fractions) in which its per-thread CPU
# use is reported: well inside the training on both sides (dataflow's cluster start-up
# and setup, and the baselines' process start, come before it).
STEADY_SPAN = (0.35, 0.85)


def print_threads(quiet: dict[str, Any]) -> None:
    """The per-process CPU table of each side's kept attempt, in steady training."""
    rows = []
    for side, q in quiet.items():
        for row in q["attempts"][-1]["steady_threads"]:
            rows.append(
                [
                    side,
                    row["process"],
                    f"{row['cores']:.3f}",
                    f"{row['busiest_thread']:.3f}",
                    f"{row['other_threads']:.3f}",
                    row["threads"],
                ]
            )
    span = f"{STEADY_SPAN[0]:.0%}-{STEADY_SPAN[1]:.0%}"
    print(f"CPU cores used per process during steady training ({span} of each side's wall):")
    header = ["side", "process", "cores", "busiest thread", "other threads", "threads"]
    print(table(rows, header))


def add_workload_args(
    p: Any, *, samples: int, epochs: int, channels: str, convs: int, hidden: int
) -> None:
    """The model, data and optimizer options both benchmarks share (defaults differ)."""
    p.add_argument("--samples", type=int, default=samples, help=f"dataset size ({samples})")
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--epochs", type=int, default=epochs, help=f"epochs per side ({epochs})")
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="steps excluded at the start, rounded up to a window end (default 10)",
    )
    p.add_argument("--channels", default=channels, help=f"conv widths per stage ({channels})")
    p.add_argument("--convs", type=int, default=convs, help=f"3x3 convs per stage ({convs})")
    p.add_argument(
        "--hidden", type=int, default=hidden, help=f"hidden units of the head ({hidden})"
    )
    p.add_argument("--image", type=int, default=32, help="image side, 3 channels (default 32)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-seconds", type=float, default=1.0, help="dataflow window_seconds")


def add_worker_args(p: Any) -> None:
    """Diagnosis switches for the dataflow side's Dask workers (defaults: as users get)."""
    p.add_argument(
        "--worker-malloc-trim",
        choices=("dask-default", "unset", "mallopt"),
        default="dask-default",
        help="dask-default: workers get distributed.nanny.pre-spawn-environ as usual "
        "(MALLOC_TRIM_THRESHOLD_=65536); unset: drop that variable; mallopt: keep it but "
        "call glibc mallopt() in the workers before the fit (diagnosis)",
    )
    p.add_argument(
        "--engine-relax-malloc",
        choices=("on", "off"),
        default="on",
        help="off: Pipeline(relax_malloc=False), the engine leaves Dask's malloc setting "
        "in place (reproduces the slowdown fixed in f58fd53; default on)",
    )
    p.add_argument(
        "--worker-gc-freeze",
        action="store_true",
        help="gc.collect() + gc.freeze() in the workers after importing torch/dataflow, "
        "before the fit (diagnosis: full-collection pauses)",
    )
    p.add_argument(
        "--worker-profile",
        choices=("on", "off"),
        default="on",
        help="off: distributed.worker.profile.enabled=False, no 10 ms stack sampling of the "
        "task thread (diagnosis; default on, as users get)",
    )


def add_quiet_args(p: Any) -> None:
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="reruns of a side disturbed by other programs on the machine (default 2)",
    )
    p.add_argument(
        "--max-wait",
        type=float,
        default=120.0,
        help="seconds to wait for a quiet machine before each side (default 120)",
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="cores used by other programs during a side above which it is rerun (0.1)",
    )


# -- output ----------------------------------------------------------------------------


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except Exception:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    import dask
    import distributed

    import dataflow

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "dataflow": dataflow.__version__,
        "git_commit": _git_commit(),
    }


def to_jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def save_run(name: str, run: dict[str, Any], out: str | Path | None, *, overwrite: bool) -> Path:
    """Append ``run`` (with machine info) to ``results/<name>.json`` (a list of runs)."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs: list[Any] = []
    if path.exists() and not overwrite:
        try:
            previous = json.loads(path.read_text())
            if previous.get("benchmark") == name:
                runs = previous.get("runs", [])
        except (ValueError, AttributeError):
            runs = []
    runs.append(to_jsonable({"machine": machine_info(), **run}))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"benchmark": name, "runs": runs}, indent=1))
    tmp.replace(path)
    return path


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
