"""Measuring a fit from its history: the steady state past the warm-up, the driver's
scheduling share, the workers' idle gaps between tasks, and their garbage collections.

The garbage-collection probes run on the Dask workers (``run_fit``), which import this
module by name: it imports nothing but the standard library."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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
