"""What bench_gpu.py trains, and how its figures become issue 37's targets.

A workload is a network, its synthetic data (a small pool of samples that the epochs
re-index: little host and device memory), its batch and step count, its sides (fits
through the engine, hand-written loops) and the ratios between them. The sizes are set
so that the whole bench fits one call of a few minutes on an H100/H200: each timed side
is a few seconds of steady state. ``tiny`` shrinks every one for the CPU smoke run.

Published throughput the full sizes were set from (an estimate, not a measurement):
ResNet-50 at 128 px in bf16 trains ~3,000-5,000 img/s on an H100, so batch 128 x 80
steps is ~2-3 s in bf16 (~5 s in fp32); a CosmoFlow network at 4 x 128^3 trains a few
hundred samples/s, so batch 16 x 48 steps is ~2-4 s.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gpu_models import CosmoFlow, GpuNet, ResNet50

MODELS = ("small", "resnet50", "cosmoflow")


@dataclass(frozen=True)
class Target:
    """Issue 37's bar for one ratio: ``numerator / denominator >= at_least``; ``ceiling``
    names the hand loops' own ratio, where the engine cannot beat its loop."""

    numerator: str
    denominator: str
    at_least: float
    ceiling: tuple[str, str] | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    model: Callable[[], torch.nn.Module]
    loss: Callable[..., torch.Tensor]
    data: Callable[[], tuple[np.ndarray, np.ndarray]]
    samples: int
    batch: int
    epochs: int
    warmup: int  # steps left out of the rate (rounded up to a window start)
    fits: dict[str, dict[str, Any]]  # name: {"source": ..., Pipeline options}
    loops: dict[str, dict[str, Any]]  # name: hand-loop options
    ratios: tuple[tuple[str, str], ...]  # (numerator side, denominator side)
    targets: dict[str, Target]
    # the sides that run before the rest, in rounds across workloads (see side_order)
    first: tuple[tuple[str, ...], ...] = ()
    fit_options: dict[str, Any] = field(default_factory=dict)  # every fit's, e.g. tiny's

    @property
    def steps(self) -> int:
        return self.samples // self.batch * self.epochs

    def sizes(self, x: np.ndarray) -> dict[str, Any]:
        return {
            "sample_shape": list(x.shape[1:]),
            "samples": self.samples,
            "batch": self.batch,
            "epochs": self.epochs,
            "steps": self.steps,
            "warmup": self.warmup,
            "fit_options": self.fit_options,
        }


def classes_data(samples: int, shape: tuple[int, ...], classes: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, *shape), dtype=np.float32)
    return x, rng.integers(0, classes, size=samples).astype(np.int64)


def regression_data(samples: int, shape: tuple[int, ...], targets: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, *shape), dtype=np.float32)
    return x, rng.uniform(-1, 1, size=(samples, targets)).astype(np.float32)


def counts_of(x: np.ndarray) -> np.ndarray:
    """Particle-count-like int16 inputs made from ``x`` (0 to a few hundred), for the
    sides that store counts and take ``log1p`` on the GPU."""
    return np.minimum(np.exp(2.0 * x), 32767).astype(np.int16)


# The small CNN's sides, named as in every run since the first H100 session.
SMALL_LOOPS: dict[str, dict[str, Any]] = {
    # name: options of the hand-written loop; "resident" keeps the data on the GPU. The
    # loops queue steps ahead as a user's script does (no sync per step); "synced" waits
    # for each step, as every loop here did before the fourth H100 session
    "torch_loop_pinned": {"resident": False},
    "torch_loop_resident": {"resident": True},
    "torch_loop_resident_synced": {"resident": True, "synced": True},
    "torch_loop_resident_bf16": {"resident": True, "bf16": True},
    "torch_loop_resident_bf16_cl": {"resident": True, "bf16": True, "channels_last": True},
    "torch_loop_resident_bf16_cl_compiled": {
        "resident": True,
        "bf16": True,
        "channels_last": True,
        "compile": True,
    },
}
SMALL_FITS: dict[str, dict[str, Any]] = {
    # name: (source, Pipeline step options); "auto" is bf16 + channels_last on an H100
    "dataflow_memory_fp32": {"source": "memory", "precision": "fp32", "channels_last": False},
    "dataflow_memory": {"source": "memory"},  # uploaded to the GPU once (data_on_device)
    "dataflow_memory_host": {"source": "memory", "data_on_device": False},
    # loader_threads: the loader alone also at 1, 2, 4 and 8 decode threads besides
    # "auto" (and pageable at "auto" on CUDA), each against its codec's own rate
    "dataflow_zarr": {"source": "zarr", "loader_threads": (1, 2, 4, 8)},
    # why zarr / memory missed (0.763, H200): the decode threads against the host-bound
    # step (one thread instead of "auto"), and the same read under a captured step
    "dataflow_zarr_decode1": {"source": "zarr", "decode_threads": 1},
    "dataflow_zarr_captured": {"source": "zarr", "capture": True},
    # the store written with compressor="lz4" (blosc's lz4, byte shuffle): ~2.5x zstd's
    # decode a thread, for a step the zstd threads could not feed (session 39)
    "dataflow_zarr_lz4": {"source": "zarr_lz4"},
    # the noise-scale auto-tuner measuring but never growing: its cost per step (item 7)
    "dataflow_memory_adaptive": {"source": "memory", "schedule": "adaptive"},
    "dataflow_memory_compiled": {"source": "memory", "compile": True},
    # forward, loss and backward replayed as a CUDA graph per input shape (capture=True)
    "dataflow_memory_captured": {"source": "memory", "capture": True},
    "dataflow_memory_fp32_captured": {
        "source": "memory",
        "precision": "fp32",
        "channels_last": False,
        "capture": True,
    },
}
SMALL_RATIOS = (  # each fit against the hand loop with its settings, then fit to fit
    ("dataflow_memory_fp32", "torch_loop_resident"),
    ("torch_loop_resident_synced", "torch_loop_resident"),
    ("dataflow_memory", "torch_loop_resident_bf16_cl"),
    ("dataflow_memory_host", "torch_loop_resident_bf16_cl"),
    ("dataflow_zarr", "torch_loop_resident_bf16_cl"),
    ("dataflow_memory_compiled", "torch_loop_resident_bf16_cl_compiled"),
    ("dataflow_memory_adaptive", "dataflow_memory"),
    ("dataflow_zarr", "dataflow_memory"),
    ("dataflow_zarr_decode1", "dataflow_zarr"),
    ("dataflow_zarr_captured", "dataflow_memory_captured"),
    ("dataflow_zarr_lz4", "dataflow_memory"),
    ("dataflow_memory", "dataflow_memory_fp32"),
    ("torch_loop_resident_bf16_cl", "torch_loop_resident"),
    # captured steps: against the same hand loops, and against the eager fits
    ("dataflow_memory_captured", "torch_loop_resident_bf16_cl"),
    ("dataflow_memory_fp32_captured", "torch_loop_resident"),
    ("dataflow_memory_captured", "dataflow_memory"),
    ("dataflow_memory_fp32_captured", "dataflow_memory_fp32"),
)
SMALL_TARGETS = {
    "fit / hand loop, fp32": Target("dataflow_memory_fp32", "torch_loop_resident", 0.95),
    "fit / hand loop, bf16 + channels_last": Target(
        "dataflow_memory", "torch_loop_resident_bf16_cl", 0.95
    ),
    "zarr fit / memory fit": Target("dataflow_zarr", "dataflow_memory", 0.9),
    "Adaptive / Fixed": Target("dataflow_memory_adaptive", "dataflow_memory", 0.95),
    # the same bars for the captured fits, beside the eager ones (not instead of them)
    "captured fit / hand loop, fp32": Target(
        "dataflow_memory_fp32_captured", "torch_loop_resident", 0.95
    ),
    "captured fit / hand loop, bf16 + channels_last": Target(
        "dataflow_memory_captured", "torch_loop_resident_bf16_cl", 0.95
    ),
}
SMALL_FIRST = (  # captured bf16 vs its loop; eager bf16; the other targets'; fp32's three
    ("dataflow_memory_captured", "torch_loop_resident_bf16_cl"),
    ("dataflow_memory",),
    # zarr and Adaptive before fp32: the first H200 call's 150 s ran fp32 and not these
    ("dataflow_zarr", "dataflow_memory_adaptive"),  # the other targets' sides
    # why zarr / memory missed: the codec's decode rate (decode1 answered: the threads
    # are needed, 0.30-0.35x with one; it runs after the first rounds now)
    ("dataflow_zarr_lz4", "dataflow_zarr_captured"),
    ("torch_loop_resident", "dataflow_memory_fp32_captured", "dataflow_memory_fp32"),
)

# The seeds' workloads: every fit names its precision and memory format (not "auto"),
# and so does the hand loop it is compared with; the loops eager, the fits eager and
# captured (capture=True: a CUDA graph per input shape).
BF16_CL = {"precision": "bf16", "channels_last": True}
SEED_FITS: dict[str, dict[str, Any]] = {
    "fit_memory_fp32": {"source": "memory", "precision": "fp32", "channels_last": False},
    "fit_memory_bf16_cl": {"source": "memory", **BF16_CL},
    "fit_zarr_bf16_cl": {"source": "zarr", **BF16_CL},
    "fit_zarr_lz4_bf16_cl": {"source": "zarr_lz4", **BF16_CL},  # compressor="lz4"
    "fit_memory_fp32_captured": {
        "source": "memory",
        "precision": "fp32",
        "channels_last": False,
        "capture": True,
    },
    "fit_memory_bf16_cl_captured": {"source": "memory", **BF16_CL, "capture": True},
}
SEED_LOOPS: dict[str, dict[str, Any]] = {
    "loop_resident_fp32": {"resident": True},
    "loop_resident_bf16_cl": {"resident": True, "bf16": True, "channels_last": True},
}
SEED_RATIOS = (
    ("fit_memory_fp32", "loop_resident_fp32"),
    ("fit_memory_bf16_cl", "loop_resident_bf16_cl"),
    ("fit_zarr_bf16_cl", "loop_resident_bf16_cl"),
    ("fit_zarr_bf16_cl", "fit_memory_bf16_cl"),
    ("fit_zarr_lz4_bf16_cl", "fit_memory_bf16_cl"),
    ("fit_memory_bf16_cl", "fit_memory_fp32"),
    ("loop_resident_bf16_cl", "loop_resident_fp32"),
    ("fit_memory_fp32_captured", "loop_resident_fp32"),
    ("fit_memory_bf16_cl_captured", "loop_resident_bf16_cl"),
    ("fit_memory_fp32_captured", "fit_memory_fp32"),
    ("fit_memory_bf16_cl_captured", "fit_memory_bf16_cl"),
    ("fit_memory_bf16_cl_captured", "fit_memory_fp32_captured"),
)
SEED_TARGETS = {
    "fit / hand loop, fp32": Target("fit_memory_fp32", "loop_resident_fp32", 0.95),
    "fit / hand loop, bf16 + channels_last": Target(
        "fit_memory_bf16_cl", "loop_resident_bf16_cl", 0.95
    ),
    "bf16 fit / fp32 fit": Target(
        "fit_memory_bf16_cl",
        "fit_memory_fp32",
        1.5,
        ceiling=("loop_resident_bf16_cl", "loop_resident_fp32"),
    ),
    "zarr fit / memory fit": Target("fit_zarr_bf16_cl", "fit_memory_bf16_cl", 0.9),
    "captured fit / hand loop, fp32": Target(
        "fit_memory_fp32_captured", "loop_resident_fp32", 0.95
    ),
    "captured fit / hand loop, bf16 + channels_last": Target(
        "fit_memory_bf16_cl_captured", "loop_resident_bf16_cl", 0.95
    ),
    "captured bf16 fit / captured fp32 fit": Target(
        "fit_memory_bf16_cl_captured",
        "fit_memory_fp32_captured",
        1.5,
        ceiling=("loop_resident_bf16_cl", "loop_resident_fp32"),
    ),
}
SEED_FIRST = (
    ("fit_memory_bf16_cl_captured", "loop_resident_bf16_cl"),
    ("fit_memory_bf16_cl",),
    ("fit_zarr_bf16_cl", "fit_zarr_lz4_bf16_cl"),
    ("loop_resident_fp32", "fit_memory_fp32_captured", "fit_memory_fp32"),
)
# CosmoFlow's inputs are particle counts: stored as int16 (half float32's bytes to decode
# and copy) with lz4, and scaled on the GPU by Transform(Log1p), as CosmoFlow trains on
# log(1 + counts). Against the float32 fit from memory: what a user with counts gets
# from streaming them (the loader alone read int16 with lz4 at 2.1-2.6x float32's
# samples/s on 2 cores: benchmarks/bench_field_codecs.py).
COUNTS_FITS = {"fit_zarr_lz4_counts_bf16_cl": {"source": "zarr_lz4_counts", **BF16_CL}}
COSMO_SEED = {
    "fits": {**SEED_FITS, **COUNTS_FITS},
    "loops": SEED_LOOPS,
    "ratios": (*SEED_RATIOS, ("fit_zarr_lz4_counts_bf16_cl", "fit_memory_bf16_cl")),
    "first": tuple(
        (*sides, *COUNTS_FITS) if "fit_zarr_lz4_bf16_cl" in sides else sides for sides in SEED_FIRST
    ),
}


def workloads(args: Any) -> dict[str, Workload]:
    """The workloads ``args.models`` names, at full size or ``args.tiny``; the small
    CNN's sizes come from ``--image``, ``--batch``, ``--samples``, ``--epochs``."""
    tiny = args.tiny
    small_fits = {k: v for k, v in SMALL_FITS.items() if k in args.fits}
    small_loops = {k: v for k, v in SMALL_LOOPS.items() if k in args.loops}
    if tiny:  # torch.compile on the CPU takes minutes: its sides run on a GPU only
        small_fits = {k: v for k, v in small_fits.items() if not v.get("compile")}
        small_loops = {k: v for k, v in small_loops.items() if not v.get("compile")}
    image, samples = (16, 8) if tiny else (args.image, args.samples)
    # 32 px, not 16: on a 1x1 map, torch's CPU bf16 channels_last stride-2 convolution
    # now and then gives non-finite weight gradients (torch 2.13, oneDNN)
    resnet_px, resnet_width, resnet_samples = (32, 8, 8) if tiny else (128, 64, 1024)
    cube, conv_size, cosmo_samples = (32, 4, 8) if tiny else (128, 32, 64)
    seed = {"fits": SEED_FITS, "loops": SEED_LOOPS, "ratios": SEED_RATIOS, "first": SEED_FIRST}
    # On the CPU, torch 2.13's bf16 channels_last_3d convolutions now and then return
    # wrong gradients (a plain torch loop too: the same 4 steps' losses differ between
    # processes, at times 1.8 for 0.26, or a non-finite gradient; about 1 run in 6):
    # the smoke run drops such a step instead of failing
    shared = {"fit_options": {"on_non_finite": "skip"} if tiny else {}}
    built = {
        "small": Workload(
            name="small",
            model=functools.partial(GpuNet, width=8) if tiny else GpuNet,
            loss=F.cross_entropy,
            data=functools.partial(classes_data, samples, (3, image, image), 10),
            samples=samples,
            batch=4 if tiny else args.batch,
            epochs=2 if tiny else args.epochs,
            warmup=2 if tiny else args.warmup,
            fits=small_fits,
            loops=small_loops,
            ratios=SMALL_RATIOS,
            targets=SMALL_TARGETS,
            first=SMALL_FIRST,
            **shared,
        ),
        "resnet50": Workload(
            name="resnet50",
            model=functools.partial(ResNet50, width=resnet_width),
            loss=F.cross_entropy,
            data=functools.partial(classes_data, resnet_samples, (3, resnet_px, resnet_px), 1000),
            samples=resnet_samples,
            batch=4 if tiny else 128,
            epochs=2 if tiny else 10,
            warmup=2 if tiny else 8,
            targets=SEED_TARGETS,
            **seed,
            **shared,
        ),
        "cosmoflow": Workload(
            name="cosmoflow",
            model=functools.partial(CosmoFlow, size=cube, conv_size=conv_size),
            loss=F.mse_loss,
            data=functools.partial(regression_data, cosmo_samples, (4, cube, cube, cube), 4),
            samples=cosmo_samples,
            batch=4 if tiny else 16,
            epochs=2 if tiny else 12,
            warmup=2 if tiny else 8,
            targets=SEED_TARGETS,
            **COSMO_SEED,
            **shared,
        ),
    }
    return {name: built[name] for name in args.models}


def side_order(workloads: dict[str, Workload]) -> list[tuple[Workload, str]]:
    """(workload, side) in the order they run, the most informative first, so that a
    spent ``--budget-s`` skips the least needed: round by round of each workload's
    ``first`` (captured bf16 + channels_last and its hand loop on every model, then the
    eager bf16 fits, then zarr and Adaptive, then fp32's loop, captured and eager fits),
    then each workload's other eager sides (fits, then loops), then the compiled ones
    (the slowest to start)."""
    order: dict[tuple[str, str], tuple[Workload, str]] = {}
    rounds = max((len(w.first) for w in workloads.values()), default=0)
    for k in range(rounds):
        for w in workloads.values():
            for side in w.first[k] if k < len(w.first) else ():
                if side in w.fits or side in w.loops:
                    order[w.name, side] = (w, side)
    for late in (False, True):
        for w in workloads.values():
            for side, options in (*w.fits.items(), *w.loops.items()):
                if bool(options.get("compile")) == late:
                    order.setdefault((w.name, side), (w, side))
    return list(order.values())


def in_first(w: Workload, side: str) -> bool:
    """Whether ``side`` runs in one of ``w``'s first rounds (see :func:`side_order`)."""
    return any(side in sides for sides in w.first)


def rate(out: dict[str, Any], side: str) -> float | None:
    """The side's steady samples/s: the median of its runs (the first and any repeats)."""
    first = out.get(side, {}).get("samples_per_s")
    if not first:
        return None
    return float(statistics.median([first, *out[side].get("repeats", [])]))


# A target's first value this close to its bar (as a fraction of the bar) is confirmed by
# more runs of its two sides (gpu_training.confirm): the spread of one run on a step
# bound by the host
UNCERTAIN_WITHIN = 0.2


def uncertain(w: Workload, out: dict[str, Any]) -> list[Target]:
    """The targets whose value (so far) lies within ``UNCERTAIN_WITHIN`` of their bar,
    the nearest first."""
    near = []
    for target in w.targets.values():
        a, b = rate(out, target.numerator), rate(out, target.denominator)
        if a is not None and b is not None:
            distance = abs(a / b / target.at_least - 1)
            if distance <= UNCERTAIN_WITHIN:
                near.append((distance, target))
    return [target for _, target in sorted(near, key=lambda pair: pair[0])]


def ratios(workload: Workload, out: dict[str, Any]) -> dict[str, float]:
    """``"numerator / denominator"``: steady samples/s of one side over the other's,
    for every pair whose two sides ran."""
    found = {}
    for numerator, denominator in workload.ratios:
        a, b = rate(out, numerator), rate(out, denominator)
        if a is not None and b is not None:
            found[f"{numerator} / {denominator}"] = a / b
    for target in workload.targets.values():  # can the zarr fit's loader keep up at all?
        alone = out.get(target.numerator, {}).get("loader_alone")
        memory = rate(out, target.denominator)
        if alone and memory:
            found[f"{target.numerator} loader alone / {target.denominator}"] = (
                alone["samples_per_s"] / memory
            )
        codec = (alone or {}).get("decode_only")
        if codec:  # the loader against its codec's ceiling: the reader's own loss
            found[f"{target.numerator} loader alone / its decode only"] = (
                alone["samples_per_s"] / codec["samples_per_s"]
            )
    return found


def spread(out: dict[str, Any], target: Target) -> list[float]:
    """The lowest and highest ratio of any numerator run over any denominator run."""

    def runs(side: str) -> list[float]:
        return [out[side]["samples_per_s"], *out[side].get("repeats", [])]

    values = [a / b for a in runs(target.numerator) for b in runs(target.denominator)]
    return [min(values), max(values)]


def targets(workload: Workload, out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each of issue 37's targets with its measured value and whether it was met
    (``met`` None, with ``missing``, when a side it needs did not run)."""
    found: dict[str, dict[str, Any]] = {}
    for label, target in workload.targets.items():
        a, b = rate(out, target.numerator), rate(out, target.denominator)
        entry: dict[str, Any] = {
            "ratio": f"{target.numerator} / {target.denominator}",
            "target": target.at_least,
            "value": None if a is None or b is None else a / b,
        }
        entry["met"] = None if entry["value"] is None else entry["value"] >= target.at_least
        runs = [
            len(out.get(side, {}).get("repeats", [])) + 1
            for side in (target.numerator, target.denominator)
        ]
        if entry["value"] is not None and max(runs) > 1:  # medians of repeated runs
            entry["runs"] = dict(zip((target.numerator, target.denominator), runs, strict=True))
            entry["spread"] = spread(out, target)
        if entry["value"] is None:
            entry["missing"] = [
                side for side, r in ((target.numerator, a), (target.denominator, b)) if r is None
            ]
        if target.ceiling:
            c_a, c_b = (rate(out, side) for side in target.ceiling)
            entry["ceiling"] = None if c_a is None or c_b is None else c_a / c_b
            entry["ceiling_ratio"] = " / ".join(target.ceiling)
        found[label] = entry
    return found
