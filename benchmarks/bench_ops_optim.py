"""Fused optimizers and gradient-path ops vs torch's, on a ResNet-50-sized parameter set.

The parameters are ResNet-50's 161 tensors (25.56 M float32 elements, shapes generated
from the architecture), with random gradients. One ``step()`` is timed for:

* FusedSGD (momentum 0.9, weight decay 1e-4) vs torch.optim.SGD with ``foreach=True``,
  ``foreach=False`` (the per-tensor loop) and ``fused=True`` where torch has it on CPU;
* FusedAdam vs torch.optim.AdamW, the same three variants;
* FusedLARS and FusedLAMB vs the same optimizers written in torch (``layerwise_torch``:
  ``_foreach`` ops, and the per-tensor loop of most ports; torch has neither);

and one call of the gradient-path ops:

* ``pack_scaled_`` (copy every gradient into one flat bucket times ``b_r / B``) vs
  ``torch._foreach_mul`` + ``torch.cat``, and vs the per-tensor ``torch.mul(out=view)``
  loop the reducer runs today;
* ``sum_of_squares`` (float64 accumulation) vs ``torch._foreach_norm`` (squared) and
  ``torch.stack([g.pow(2).sum() ...])`` (both float32).

Bandwidth counts the bytes a single fused pass must move (SGD with momentum reads p, g,
m and writes p, m: 5 x 4 bytes per element; AdamW 7 x 4), for every variant, beside a
plain copy of the same size measured in the same run (``dst.copy_(src)``: 2 x 4 bytes per
element, the practical memory-bandwidth limit). Torch and numba use the same number of
threads (``--threads``). Each variant is warmed up (compiled) first; the variants are then
timed round-robin, one call each per round, and the median over rounds is reported.

    python benchmarks/bench_ops_optim.py                 # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numba
import torch
from layerwise_torch import TorchLAMB, TorchLARS
from quiet import wait_quiet
from records import save_run, table

from dataflow.ops import flat
from dataflow.ops.layerwise import FusedLAMB, FusedLARS
from dataflow.ops.optim import FusedAdam, FusedSGD
from dataflow.tools.cpu_meter import CpuMeter

NAME = "ops_optim"


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's resnet50 (161 tensors, 25,557,032 elements)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if block == 0:
                shapes += [(4 * width, inplanes, 1, 1), (4 * width,), (4 * width,)]
            inplanes = 4 * width
    return [*shapes, (1000, 2048), (1000,)]


def make_params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.05)
        p.grad = torch.randn(shape, generator=g) * 1e-3
        params.append(p)
    return params


def torch_variants(cls: type, **kw: Any) -> dict[str, Callable[[list], Any]]:
    """foreach, for-loop, and fused when torch supports it on CPU (else left out)."""
    variants = {
        "torch foreach": lambda ps: cls(ps, foreach=True, **kw),
        "torch for-loop": lambda ps: cls(ps, foreach=False, **kw),
    }
    try:
        probe = torch.nn.Parameter(torch.zeros(4))
        probe.grad = torch.zeros(4)
        cls([probe], fused=True, **kw).step()
        variants["torch fused"] = lambda ps: cls(ps, fused=True, **kw)
    except (RuntimeError, ValueError):
        pass
    return variants


def time_round_robin(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict:
    """Median seconds per call of each entry, timed one call each per round."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def measure(group: str, calls: dict[str, Callable[[], Any]], args: Any) -> tuple[dict, float]:
    """:func:`time_round_robin`, rerun (up to ``--retries``) while other programs used more
    than ``--max-foreign`` cores meanwhile; returns the medians and those cores."""
    for attempt in range(args.retries + 1):
        wait_quiet(args.max_wait)
        with CpuMeter() as meter:
            medians = time_round_robin(calls, args.repeats, args.warmup)
        foreign = meter.foreign_cpu_seconds / meter.wall_seconds
        if foreign <= args.max_foreign:
            break
        print(f"  {group}: disturbed ({foreign:.2f} cores used by others), attempt {attempt + 1}")
    return medians, foreign


def optimizer_calls(shapes, seed, ours, theirs) -> dict[str, Callable[[], Any]]:
    calls = {}
    for name, make in {"dataflow fused": ours, **theirs}.items():
        opt = make(make_params(shapes, seed))
        calls[name] = opt.step
    return calls


def op_calls(shapes, seed) -> dict[str, dict[str, Callable[[], Any]]]:
    grads = [p.grad for p in make_params(shapes, seed)]
    n = sum(g.numel() for g in grads)
    bucket = torch.empty(n)
    views = [bucket[o : o + g.numel()] for o, g in zip(offsets(grads), grads, strict=True)]
    w = 0.37

    def reducer_loop() -> None:
        for g, view in zip(grads, views, strict=True):
            torch.mul(g.reshape(-1), w, out=view)

    return {
        "pack_scaled_": {
            "dataflow fused": lambda: flat.pack_scaled_(bucket, grads, w),
            "torch _foreach_mul + cat": lambda: torch.cat(
                [t.reshape(-1) for t in torch._foreach_mul(grads, w)], out=bucket
            ),
            "torch mul(out=view) loop": reducer_loop,
        },
        "sum_of_squares": {
            "dataflow fused": lambda: flat.sum_of_squares(grads),
            "torch _foreach_norm": lambda: torch.stack(torch._foreach_norm(grads)).square(),
            "torch stack(pow(2).sum())": lambda: torch.stack([g.pow(2).sum() for g in grads]),
        },
    }


def check_same_steps(shapes, ours, theirs, kw) -> None:
    """The torch forms train as ours does (3 steps on a slice of the shapes), so the
    comparison is between equal work."""
    results = []
    for make in (ours, lambda ps, **k: theirs(ps, **k, foreach=True),
                 lambda ps, **k: theirs(ps, **k, foreach=False)):  # fmt: skip
        params = make_params(shapes[:12], seed=7)
        opt = make(params, **kw)
        for _ in range(3):
            opt.step()
        results.append(params)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def copy_calls(elements: int) -> dict[str, Callable[[], Any]]:
    source, target = torch.randn(elements), torch.empty(elements)
    return {"torch copy_": lambda: target.copy_(source)}


HEADER = ["op", "variant", "ms", "GB/s", "vs best unfused torch", "others' cores"]


def cells(row: dict[str, Any]) -> list[str]:
    ratio = row["speedup_vs_best_torch"]
    return [
        row["op"],
        row["variant"],
        f"{row['ms']:.2f}",
        f"{row['GB/s']:.1f}",
        "" if ratio is None else f"{ratio:.2f}x",
        f"{row['foreign_cores']:.2f}",
    ]


def offsets(tensors: list[torch.Tensor]) -> list[int]:
    out, at = [], 0
    for t in tensors:
        out.append(at)
        at += t.numel()
    return out


BYTES_PER_ELEMENT = {  # what one fused pass reads + writes, float32
    "FusedSGD step (momentum, weight decay)": 5 * 4,
    "FusedAdam step (AdamW)": 7 * 4,
    "FusedLARS step (momentum, weight decay)": 7 * 4,  # norms: p, g; update: p, g, m -> p, m
    "FusedLAMB step": 10 * 4,  # moments: p, g, m, v -> m, v; update: p, m, v -> p
    "pack_scaled_": 2 * 4,
    "sum_of_squares": 4,
    "copy (bandwidth reference)": 2 * 4,
}


def rows_for(
    group: str, measured: tuple[dict[str, float], float], elements: int
) -> list[dict[str, Any]]:
    """One row per variant: ms, GB/s, and our speed-up over the best non-fused torch."""
    medians, foreign = measured
    torch_unfused = [s for k, s in medians.items() if k.startswith("torch") and "fused" not in k]
    best = min(torch_unfused) if torch_unfused else None
    rows = []
    for variant, seconds in medians.items():
        rows.append(
            {
                "op": group,
                "variant": variant,
                "ms": seconds * 1e3,
                "GB/s": BYTES_PER_ELEMENT[group] * elements / seconds / 1e9,
                "speedup_vs_best_torch": (best / seconds) if best else None,
                "foreign_cores": foreign,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    usable = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, default=usable, help=f"torch and numba ({usable})")
    p.add_argument("--repeats", type=int, default=25, help="timed rounds (default 25)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for quiet")
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="cores used by other programs during a group above which it is rerun (0.1)",
    )
    p.add_argument("--retries", type=int, default=2, help="reruns of a disturbed group (2)")
    p.add_argument("--out", default=None, help="JSON path (default results/ops_optim.json)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier runs in --out")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    shapes = resnet50_shapes()
    elements = sum(torch.Size(s).numel() for s in shapes)
    print(f"{len(shapes)} tensors, {elements:,} float32 elements; {args.threads} threads")

    rows: list[dict[str, Any]] = []
    group = "copy (bandwidth reference)"
    rows += rows_for(group, measure(group, copy_calls(elements), args), elements)

    sgd = dict(lr=0.01, momentum=0.9, weight_decay=1e-4)
    calls = optimizer_calls(
        shapes,
        args.seed,
        lambda ps: FusedSGD(ps, **sgd),
        torch_variants(torch.optim.SGD, **sgd),
    )
    group = "FusedSGD step (momentum, weight decay)"
    rows += rows_for(group, measure(group, calls, args), elements)
    del calls

    adam = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    calls = optimizer_calls(
        shapes,
        args.seed,
        lambda ps: FusedAdam(ps, **adam),
        torch_variants(torch.optim.AdamW, **adam),
    )
    group = "FusedAdam step (AdamW)"
    rows += rows_for(group, measure(group, calls, args), elements)
    del calls

    lars = dict(lr=1.0, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001)
    lamb = dict(lr=1e-3, weight_decay=1e-2)
    layerwise = {
        "FusedLARS step (momentum, weight decay)": (FusedLARS, TorchLARS, lars),
        "FusedLAMB step": (FusedLAMB, TorchLAMB, lamb),
    }
    for group, (ours, theirs, kw) in layerwise.items():
        check_same_steps(shapes, ours, theirs, kw)
        variants = {
            "torch foreach": lambda ps, t=theirs, kw=kw: t(ps, **kw, foreach=True),
            "torch for-loop": lambda ps, t=theirs, kw=kw: t(ps, **kw, foreach=False),
        }
        calls = optimizer_calls(shapes, args.seed, lambda ps, o=ours, kw=kw: o(ps, **kw), variants)
        rows += rows_for(group, measure(group, calls, args), elements)
        del calls

    for group, calls in op_calls(shapes, args.seed).items():
        rows += rows_for(group, measure(group, calls, args), elements)

    print(table([cells(r) for r in rows], HEADER))
    run = {
        "args": vars(args),
        "tensors": len(shapes),
        "elements": elements,
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.get_num_threads(),
        "numba_threading_layer": numba.threading_layer(),
        "rows": rows,
    }
    print(f"saved to {save_run(NAME, run, args.out, overwrite=args.overwrite)}")


if __name__ == "__main__":
    main()
