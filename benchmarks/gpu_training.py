"""bench_gpu.py's training part: each workload's fits through the engine against
hand-written torch loops with the same precision, memory format and compile mode.

One LocalCluster (one worker) serves every fit. A fit's rate is its steady state from
the first window start past the warm-up; each hand loop counts the same steps. The
loops train on a Fixed pipeline's own sample plan, so they need no fit to have run.
The sides run across workloads, the most informative first (``side_order``: captured
bf16 + channels_last against its hand loop on every model, first). A side that raises
is recorded with its error and the others go on; a side that would not end before the
deadline (by the longest of its workload's fits, or loops, so far) is recorded as
skipped, so one call always leaves its figures. A ``capture=True`` side needs CUDA.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gpu_device import Device
from gpu_models import parameter_count, sgd
from gpu_workloads import (
    Workload,
    counts_of,
    in_first,
    ratios,
    side_order,
    targets,
    uncertain,
)
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
    options = ("precision", "memory_format", "compile", "capture")
    return {
        "samples_per_s": steady_fit(steps, first).samples_per_second,
        "first_step": first,
        "steps": len(steps),
        "device": worker.get("device"),
        "step_options": {k: worker.get(k) for k in options},
        "compile_seconds": phase.compile_seconds,
        "compiled_shapes": phase.compiled_shapes,
        # capture=True: per replica, seconds capturing, shapes captured, steps replayed
        # (the rest ran eagerly) and why a shape could not be captured
        **{
            key: getattr(phase, key, None)
            for key in ("capture_seconds", "captured_shapes", "captured_steps", "capture_failures")
        },
        # the replica's host time per step in each stage (the whole fit): where a
        # host-bound fit's time goes, without a profiler
        "host_ms_per_step": {
            stage: round(1000 * seconds / phase.steps, 3)
            for stage, seconds in phase.stage_seconds[0].items()
        },
    }


def capture_unavailable(device: Device) -> str | None:
    """Why a ``capture=True`` side cannot run here (None: it can): CUDA graphs need a
    GPU, except where the engine's CPU simulation is asked for
    (``DATAFLOW_SIMULATE_CAPTURE=1``, tests only)."""
    import dataclasses

    from dataflow.trainer_config import TrainerConfig

    if "capture" not in {f.name for f in dataclasses.fields(TrainerConfig)}:
        return "this checkout's Pipeline has no capture= option"
    if not device.cuda and os.environ.get("DATAFLOW_SIMULATE_CAPTURE") != "1":
        return "needs CUDA"
    return None


@dataclass
class Sides:
    """What one workload's sides share: its data, its sources (the zarr store written
    when a side first needs it) and its sample plan, each made when first needed."""

    w: Workload
    device: Device
    tmp: str
    out: dict[str, Any]
    data: tuple[Any, Any] | None = None
    sources: dict[str, Any] = field(default_factory=dict)
    batches: list[np.ndarray] | None = None

    def arrays(self) -> tuple[Any, Any]:
        if self.data is None:
            self.data = x, _ = self.w.data()
            self.out.update(sizes=self.w.sizes(x), parameters=parameter_count(self.w.model()))
        return self.data

    def source(self, kind: str) -> Any:
        import dataflow as dfl

        if kind not in self.sources:
            x, y = self.arrays()
            if kind.startswith("zarr"):  # to_zarr's default codec (zstd), or lz4
                path = f"{self.tmp}/{self.w.name}.{kind}"
                codec = {"compressor": "lz4"} if kind.startswith("zarr_lz4") else {}
                stored = counts_of(x) if kind.endswith("_counts") else x  # int16
                dfl.io.to_zarr(path, stored, y, **codec)
                self.sources[kind] = dfl.io.ZarrSource(path, y="y")
            else:
                self.sources[kind] = dfl.io.ArraySource(x, y)
        return self.sources[kind]

    def plan(self) -> list[np.ndarray]:
        """The Fixed pipeline's global batches, which the hand loops train on."""
        if self.batches is None:
            pipe = pipeline(self.w, self.source("memory"), self.device)
            plan = pipe.sample_plan(epochs=self.w.epochs, replicas=1)
            self.batches = [np.concatenate(parts) for parts in plan]
        return self.batches

    def longest(self, pool: dict[str, Any]) -> float:
        """The longest wall time of this workload's sides in ``pool`` so far (0: none):
        what the next such side is expected to take."""
        walls = [
            v["wall_s"] for k, v in self.out.items() if k in pool and "samples_per_s" in v
        ]  # fmt: skip
        return max(walls, default=0.0)


def loader_alone(
    source: Any,
    batches: list[np.ndarray],
    cuda: bool,
    threads: int | str = "auto",
    pinned: bool = True,
) -> dict[str, Any]:
    """On a worker: how fast the fit's loader delivers ``batches`` of a chunked source with
    nothing else running, as the Load stage reads them (the chunks each decoded once on
    the fit's ``threads`` decode threads, each batch assembled in pinned memory and copied to the
    GPU on a side stream). Against the memory fit's rate, it says whether a zarr fit can
    keep up at all: one that cannot is bound by the data, not by the engine's host time."""
    from dataflow.io.batch_buffers import BatchBuffers
    from dataflow.io.chunk_reader import EpochChunkReader, auto_decode_threads
    from dataflow.io.device_staging import CudaCopies, DeviceStager

    device = torch.device("cuda" if cuda else "cpu")
    threads = auto_decode_threads(device) if threads == "auto" else threads
    stager = DeviceStager(CudaCopies(device)) if cuda else None
    buffers = BatchBuffers(keep=6, pin_memory=cuda and pinned)  # pinned=False: pageable
    started = time.perf_counter()
    first = None  # when the first batch was staged: the rate counts from there (a short
    # epoch's first batch, decoded with nothing ahead, halved CosmoFlow's figure)
    for batch in EpochChunkReader(source, batches, buffers=buffers, decode_threads=threads):
        if stager is not None:
            stager.stage(batch)
        if first is None:
            if cuda:
                torch.cuda.synchronize()
            first = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    ended = time.perf_counter()
    samples = sum(len(b) for b in batches)
    steady = samples - len(batches[0]) if len(batches) > 1 else samples
    seconds = (ended - first) if len(batches) > 1 else (ended - started)
    return {
        "samples_per_s": steady / seconds,
        "first_batch_s": first - started,
        "decode_threads": threads,
        "samples": samples,
        "decode_only": decode_only(source, batches, threads),
    }


def loader_by_threads(
    source: Any, batches: list[np.ndarray], cuda: bool, counts: tuple[int, ...]
) -> list[dict[str, Any]]:
    """On a worker: :func:`loader_alone` at each decode thread count of ``counts`` up to
    the "auto" count, and at "auto" itself; on CUDA, also the "auto" read into pageable
    buffers. How the loader and its codec scale with threads: on the H200 the small
    CNN's loader read 3.2x one thread's rate with 15. The last row read as the fit
    reads ("auto", pinned on CUDA) stands for :func:`loader_alone` of the side."""
    from dataflow.io.chunk_reader import auto_decode_threads

    most = auto_decode_threads(torch.device("cuda" if cuda else "cpu"))
    rows = []
    for threads in sorted({*(t for t in counts if t < most), most}):
        rows.append({"pinned": cuda, **loader_alone(source, batches, cuda, threads)})
    if cuda:
        rows.append({"pinned": False, **loader_alone(source, batches, cuda, most, pinned=False)})
    return rows


def loader_table(rows: list[dict[str, Any]]) -> str:
    header = ("decode threads", "pinned", "loader samples/s", "decode only samples/s")
    return table(
        [
            (
                str(r["decode_threads"]),
                "yes" if r["pinned"] else "no",
                f"{r['samples_per_s']:.0f}",
                f"{r['decode_only']['samples_per_s']:.0f}",
            )
            for r in rows
        ],
        header,
    )


def decode_only(source: Any, batches: list[np.ndarray], threads: int) -> dict[str, Any]:
    """The codec's own ceiling for the loader above: every chunk of the epoch decoded once
    on ``threads`` threads (one ``read_chunks`` call a chunk, nothing assembled, copied or
    staged), the faster of two passes (one pass of the small CNN's epoch ranged 21k-32k
    samples/s on 2 cores). A loader near this rate is bound by the codec (a faster codec
    or a narrower dtype is the next step); one well below it loses time in the reader."""
    from concurrent.futures import ThreadPoolExecutor

    from dataflow.io.chunk_index import chunk_index

    index = chunk_index(source)
    chunks = sorted({int(c) for b in batches for c in index.of(b)})
    samples = int(sum(index.size(c) for c in chunks))
    passes = []
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="decode-only") as pool:
        for _ in range(2):
            started = time.perf_counter()
            decoded = sum(1 for _ in pool.map(lambda c: source.read_chunks([c]), chunks))
            passes.append(samples / (time.perf_counter() - started))
    return {"samples_per_s": max(passes), "passes": passes, "chunks": decoded, "samples": samples}


def run_fit(sides: Sides, name: str, variant: dict[str, Any], client: Any) -> dict[str, Any]:
    w = sides.w
    bench_only = ("source", "loader_threads")  # what the bench reads, not the Pipeline
    options = {**w.fit_options, **{k: v for k, v in variant.items() if k not in bench_only}}
    if variant["source"].endswith("_counts"):  # int16 counts: log1p on the device
        from dataflow.ops.transforms import Log1p

        options["transforms"] = [Log1p(dtype=torch.float32)]
    alone = None
    if variant["source"].startswith("zarr"):  # one epoch read with nothing else running
        epoch = sides.plan()[: max(1, w.samples // w.batch)]
        source = sides.source(variant["source"])
        threads = variant.get("decode_threads", "auto")  # as the fit's Load decodes
        sweep = variant.get("loader_threads")
        if sweep and threads == "auto" and name not in sides.out:  # once a side
            rows = client.submit(
                loader_by_threads, source, epoch, sides.device.cuda, sweep, pure=False
            ).result()
            print(f"{w.name} {name}: the loader alone by decode threads:")
            print(loader_table(rows))
            # the last row read as the fit does ("auto", pinned on CUDA): not read again
            alone = {**[r for r in rows if r["pinned"] == sides.device.cuda][-1]}
            alone["by_threads"] = rows
        else:
            alone = client.submit(
                loader_alone, source, epoch, sides.device.cuda, threads, pure=False
            ).result()
        print(
            f"{w.name} {name}: the loader alone: {alone['samples_per_s']:.0f} samples/s; "
            f"its chunks decoded alone: {alone['decode_only']['samples_per_s']:.0f}"
        )
    result = pipeline(w, sides.source(variant["source"]), sides.device, **options).fit(
        epochs=w.epochs, client=client
    )
    figures = fit_figures(result, w.warmup)
    if alone is not None:
        figures["loader_alone"] = alone
    print(f"{w.name} {name}: host ms per step by stage: {figures['host_ms_per_step']}")
    if variant.get("capture"):
        print(
            f"{w.name} {name}: captured steps {figures['captured_steps']}, capture "
            f"seconds {figures['capture_seconds']}, failures {figures['capture_failures']}"
        )
    return figures


def run_loop(sides: Sides, options: dict[str, Any]) -> dict[str, Any]:
    w = sides.w
    x, y = sides.arrays()
    batches = sides.plan()
    # the steps the first fit that ran counted, so the loops time the same ones
    first = next(
        (v["first_step"] for v in sides.out.values() if isinstance(v, dict) and "first_step" in v),
        min(w.warmup, len(batches) - 1),
    )
    samples = sum(len(b) for b in batches[first:])
    try:
        ends, first_step_s = hand_loop(w, sides.device, x, y, batches, **options)
    finally:
        gc.collect()
        sides.device.release()
    return {"samples_per_s": samples / (ends[-1] - ends[first - 1]), "first_step_s": first_step_s}


def time_side(sides: Sides, name: str, client: Any) -> dict[str, Any]:
    """Side ``name`` timed once: a fit through the engine, or a hand loop."""
    w = sides.w
    if name in w.fits:
        return run_fit(sides, name, w.fits[name], client)
    return run_loop(sides, w.loops[name])


def run_side(sides: Sides, name: str, client: Any, budget: Budget) -> None:
    """One side into ``sides.out[name]``: its figures, its error (one broken side must
    not cost the others' figures), or why it was skipped."""
    w, out = sides.w, sides.out
    is_fit = name in w.fits
    options = w.fits[name] if is_fit else w.loops[name]
    unavailable = capture_unavailable(sides.device) if options.get("capture") else None
    if unavailable:
        out[name] = {"skipped": unavailable}
        return
    expected = sides.longest(w.fits if is_fit else w.loops)
    if budget.spent(needing=expected):
        out[name] = {"skipped": "the bench's time budget (--budget-s) was spent"}
        if expected:
            out[name]["skipped"] += f" (its workload's {'fits' if is_fit else 'loops'} took"
            out[name]["skipped"] += f" up to {expected:.0f} s)"
        return
    started = time.perf_counter()
    try:
        out[name] = time_side(sides, name, client)
    except Exception as error:
        print(f"{w.name} {name}: failed: {type(error).__name__}: {error}")
        out[name] = {"error": f"{type(error).__name__}: {error}"}
    out[name]["wall_s"] = round(time.perf_counter() - started, 1)


def repeat_side(sides: Sides, name: str, client: Any, budget: Budget) -> bool:
    """Time side ``name`` again, its rate appended to ``out[name]["repeats"]``; False when
    the budget has no room for it (by its own first run) or it fails."""
    w, first = sides.w, sides.out.get(name, {})
    if "samples_per_s" not in first or budget.spent(needing=first["wall_s"]):
        return False
    try:
        figures = time_side(sides, name, client)
    except Exception as error:
        print(f"{w.name} {name}: repeat failed: {type(error).__name__}: {error}")
        return False
    first.setdefault("repeats", []).append(figures["samples_per_s"])
    return True


def confirm(
    shared: dict[str, Sides], client: Any, budget: Budget, rounds: int, saved: Callable
) -> None:
    """Up to ``rounds`` more runs of the sides of every target whose first value lies near
    its bar (``uncertain``), interleaved (denominator, numerator, ...) so that a drift of
    the machine's speed during the call reaches both; the targets then read each side's
    median rate. On a step bound by the host, runs of ~1 s differ by 20-30% between
    calls: one run per side cannot tell 0.93 from 0.97."""
    for k in range(rounds):
        ran = False
        for sides in shared.values():
            report(sides.w, sides.out, show=False)
            done: set[str] = set()
            for target in uncertain(sides.w, sides.out):
                for name in (target.denominator, target.numerator):
                    if name not in done:
                        done.add(name)
                        ran |= repeat_side(sides, name, client, budget)
                        saved()
        if not ran:
            return
        print(f"confirm round {k + 1} of {rounds}: done")


def report(w: Workload, out: dict[str, Any], show: bool = True) -> None:
    """The workload's ratios and targets from the sides that ran (printed if ``show``)."""
    out["ratios"] = ratios(w, out)
    out["targets"] = targets(w, out)
    if not show:
        return
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
    confirm_rounds: int = 0,
) -> None:
    """``training[workload]``: its sides, ratios and targets, filled as each side ends
    (``saved`` after each), the sides in :func:`side_order` (most informative first).
    Once the sides of every workload's ``first`` rounds have run, the sides of targets
    near their bar run ``confirm_rounds`` more times (:func:`confirm`), before the rest."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, dashboard_address=":0", silence_logs=logging.ERROR
        ) as cluster,
        Client(cluster) as client,
        tempfile.TemporaryDirectory() as tmp,
    ):
        shared: dict[str, Sides] = {}
        confirmed = False
        for w, name in side_order(workloads):
            if not confirmed and not in_first(w, name):
                confirm(shared, client, budget, confirm_rounds, saved)
                confirmed = True
            if w.name not in shared:
                training[w.name] = {}
                shared[w.name] = Sides(w, device, tmp, training[w.name])
            run_side(shared[w.name], name, client, budget)
            report(w, training[w.name], show=False)
            saved()
        if not confirmed:
            confirm(shared, client, budget, confirm_rounds, saved)
        for name, sides in shared.items():
            report(workloads[name], sides.out)
        saved()
