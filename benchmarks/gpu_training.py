"""bench_gpu.py's training part: each workload's fits through the engine against
hand-written torch loops with the same precision, memory format and compile mode.

One LocalCluster (one worker) serves every fit. A fit's rate is its steady state from
the first window start past the warm-up; each hand loop counts the same steps. The
loops train on a Fixed pipeline's own sample plan, so they need no fit to have run.
A side that raises is recorded with its error and the others go on; a side not started
before the deadline is recorded as skipped, so one call always leaves its figures.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gpu_device import Device
from gpu_models import parameter_count, sgd
from gpu_workloads import Workload, ratios, targets
from measure import steady_boundary, steady_fit
from records import table


class Budget:
    """The wall-clock seconds the training part may start sides in."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def spent(self, needing: float = 0.0) -> bool:
        """Whether fewer than ``needing`` seconds are left (none: the deadline passed)."""
        return self.deadline is not None and time.monotonic() + needing >= self.deadline


def memory_format(ndim: int) -> torch.memory_format:
    """channels_last for a batch of images (N, C, H, W), channels_last_3d for volumes."""
    return torch.channels_last if ndim == 4 else torch.channels_last_3d


def hand_loop(
    w: Workload,
    device: Device,
    x_np: np.ndarray,
    y_np: np.ndarray,
    batches: list[np.ndarray],
    resident: bool,
    bf16: bool = False,
    channels_last: bool = False,
    compile: bool = False,
    synced: bool = False,
) -> tuple[list[float], float]:
    """Step end times of the hand-written loop over the fit's own batches, and the
    seconds its first step took (compilation included when ``compile``).

    Unless ``synced``, the host never waits for the device inside the loop: the sample
    indices are uploaded before the clock starts, and each step's end is read after the
    last step. ``synced`` uploads each step's indices from pageable memory and waits for
    every step: the host's launch time then adds to the GPU's instead of overlapping it,
    which flattered the fit in earlier runs."""
    torch.manual_seed(0)
    model = w.model().to(device.torch).train()
    fmt = memory_format(x_np.ndim)
    if channels_last:
        model = model.to(memory_format=fmt)
    opt = sgd(model.parameters())
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    if resident:
        x, y = device.upload(x), device.upload(y)
    indices = [torch.from_numpy(index) for index in batches]
    if not synced:
        indices = [index.to(x.device) for index in indices]

    def forward_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return w.loss(model(xb), yb)

    step_loss = torch.compile(forward_loss) if compile else forward_loss
    clock = device.clock()
    clock.start()
    for index in indices:
        idx = index.to(x.device)
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        if not resident:
            xb, yb = device.upload(xb, pinned=True), device.upload(yb, pinned=True)
        if channels_last:
            xb = xb.contiguous(memory_format=fmt)
        loss = step_loss(xb, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        clock.mark()
        if synced:
            device.sync()
    ends = clock.ends()
    return ends, ends[0]


def pipeline(
    w: Workload, source: Any, device: Device, schedule: str = "fixed", **options: Any
) -> Any:
    import dataflow as dfl

    if schedule == "adaptive":  # one phase at the fixed batch: only the measurement differs
        chosen = dfl.schedule.Adaptive(w.batch, max_batch=w.batch, epochs_per_phase=w.epochs)
    else:
        chosen = dfl.schedule.Fixed(w.batch)
    return dfl.Pipeline(
        model=w.model,
        loss=w.loss,
        optimizer=sgd,
        source=source,
        schedule=chosen,
        device=device.type,
        replicas=1,
        progress=False,
        **options,
    )


def fit_figures(result: Any, warmup: int) -> dict[str, Any]:
    """A fit's steady rate, the options its worker resolved, and where its host time went."""
    steps = result.history.steps
    first = steady_boundary(steps, warmup)
    worker = result.history.info["workers"][0]
    phase = result.history.phases[0]
    return {
        "samples_per_s": steady_fit(steps, first).samples_per_second,
        "first_step": first,
        "steps": len(steps),
        "device": worker.get("device"),
        "step_options": {k: worker.get(k) for k in ("precision", "memory_format", "compile")},
        "compile_seconds": phase.compile_seconds,
        "compiled_shapes": phase.compiled_shapes,
        # the replica's host time per step in each stage (the whole fit): where a
        # host-bound fit's time goes, without a profiler
        "host_ms_per_step": {
            stage: round(1000 * seconds / phase.steps, 3)
            for stage, seconds in phase.stage_seconds[0].items()
        },
    }


def compiled(variants: dict[str, dict[str, Any]], wanted: bool) -> dict[str, dict[str, Any]]:
    """The compiled sides (``wanted``) or the others: compiled ones run last, the least
    needed of the run's figures and the slowest to start."""
    return {k: v for k, v in variants.items() if bool(v.get("compile")) == wanted}


def run_fits(
    w: Workload, fits: dict[str, dict[str, Any]], client: Any, device: Device, x: Any,
    y: Any, tmp: str, budget: Budget, out: dict[str, Any], saved: Callable[[], None],
) -> None:  # fmt: skip
    import dataflow as dfl

    sources: dict[str, Any] = {"memory": dfl.io.ArraySource(x, y)}
    for name, variant in fits.items():
        if budget.spent():
            out[name] = {"skipped": "the bench's time budget (--budget-s) was spent"}
            continue
        started = time.perf_counter()
        try:
            if variant["source"] not in sources:  # written once, when first needed
                dfl.io.to_zarr(f"{tmp}/{w.name}.zarr", x, y)
                sources["zarr"] = dfl.io.ZarrSource(f"{tmp}/{w.name}.zarr", y="y")
            options = {**w.fit_options, **{k: v for k, v in variant.items() if k != "source"}}
            result = pipeline(w, sources[variant["source"]], device, **options).fit(
                epochs=w.epochs, client=client
            )
            out[name] = fit_figures(result, w.warmup)
            print(f"{w.name} {name}: host ms per step by stage: {out[name]['host_ms_per_step']}")
        except Exception as error:  # one broken side must not cost the others' figures
            print(f"{w.name} {name}: failed: {type(error).__name__}: {error}")
            out[name] = {"error": f"{type(error).__name__}: {error}"}
        out[name]["wall_s"] = round(time.perf_counter() - started, 1)
        saved()


def run_loops(
    w: Workload, loops: dict[str, dict[str, Any]], device: Device, x: Any, y: Any,
    budget: Budget, out: dict[str, Any], saved: Callable[[], None],
) -> None:  # fmt: skip
    import dataflow as dfl

    plan = pipeline(w, dfl.io.ArraySource(x, y), device).sample_plan(epochs=w.epochs, replicas=1)
    batches = [np.concatenate(parts) for parts in plan]
    # the steps the first fit that ran counted, so the loops time the same ones
    first = next(
        (v["first_step"] for v in out.values() if isinstance(v, dict) and "first_step" in v),
        min(w.warmup, len(batches) - 1),
    )
    samples = sum(len(b) for b in batches[first:])
    for name, options in loops.items():
        if budget.spent():
            out[name] = {"skipped": "the bench's time budget (--budget-s) was spent"}
            continue
        started = time.perf_counter()
        try:
            ends, first_step_s = hand_loop(w, device, x, y, batches, **options)
            out[name] = {
                "samples_per_s": samples / (ends[-1] - ends[first - 1]),
                "first_step_s": first_step_s,
            }
        except Exception as error:
            print(f"{w.name} {name}: failed: {type(error).__name__}: {error}")
            out[name] = {"error": f"{type(error).__name__}: {error}"}
        gc.collect()
        device.release()
        out[name]["wall_s"] = round(time.perf_counter() - started, 1)
        saved()


def report(w: Workload, out: dict[str, Any]) -> None:
    """The workload's ratios and targets from the sides that ran, printed."""
    out["ratios"] = ratios(w, out)
    out["targets"] = targets(w, out)
    sides = [k for k, v in out.items() if isinstance(v, dict) and "samples_per_s" in v]
    print(
        table(
            [[k, f"{out[k]['samples_per_s']:.0f}"] for k in sides],
            [f"{w.name} side", "samples/s (steady)"],
        )
    )
    for label, ratio in out["ratios"].items():
        print(f"{w.name}: {label}: {ratio:.3f}")


def run_training(
    workloads: dict[str, Workload],
    device: Device,
    budget: Budget,
    training: dict[str, dict[str, Any]],
    saved: Callable[[], None],
) -> None:
    """``training[workload]``: its sides, ratios and targets, filled as each side ends
    (``saved`` after each); every workload's eager sides first, then the compiled ones."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, dashboard_address=":0", silence_logs=logging.ERROR
        ) as cluster,
        Client(cluster) as client,
        tempfile.TemporaryDirectory() as tmp,
    ):
        data = {}
        for late in (False, True):
            for name, w in workloads.items():
                fits, loops = compiled(w.fits, late), compiled(w.loops, late)
                if not (fits or loops):
                    continue
                if name not in data:
                    data[name] = x, y = w.data()
                    training[name] = {"sizes": w.sizes(x), "parameters": parameter_count(w.model())}
                x, y = data[name]
                run_fits(w, fits, client, device, x, y, tmp, budget, training[name], saved)
                run_loops(w, loops, device, x, y, budget, training[name], saved)
                report(w, training[name])
                saved()
