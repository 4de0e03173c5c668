"""On one CUDA GPU: dataflow's ops against torch, and one-replica fits of three
networks against hand-written torch loops.

Two parts, each side timed in the same run, ratios printed:

* ``training`` (first: its figures matter most): for each of ``--models``, fits by
  ``Pipeline.fit(replicas=1)`` on a one-worker LocalCluster against a hand-written
  torch loop with the same precision, memory format and compile mode, over the same
  sample plan. ``small``: bench_gpu's CNN (``--image`` px, ``--batch``, ``--epochs``),
  with its sides since the first H100 session (data from memory and from zarr, auto,
  fp32, host batches, ``Adaptive``, compiled; loops pinned, resident, synced, bf16,
  channels_last, compiled). ``resnet50`` (ResNet-50 at 128 px, batch 128, 80 steps)
  and ``cosmoflow`` (the CosmoFlow network on 4 x 128^3 volumes, batch 16, 48 steps):
  fits in fp32 and in bf16 + channels_last from memory, and bf16 + channels_last from
  zarr, against resident loops in fp32 and bf16 + channels_last, all eager. Every
  model also fits with ``capture=True`` (each steady step's forward, loss and backward
  replayed as a CUDA graph) in fp32 and in bf16 + channels_last, against the same
  eager hand loops and the eager fits; CUDA only (recorded as skipped on the CPU).
  Sides run across the models, the most informative first: captured bf16 +
  channels_last and its loop on each model, then the eager bf16 fits, then fp32's
  loop, captured and eager fits, then the rest, the compiled sides last. Steady
  state: from the first window start past each workload's warm-up. Each fit records
  its replica's host milliseconds per step in each stage (captured fits: capture
  seconds and the steps replayed).
* ``kernels``: ``ops.flat`` (pack_scaled_, sum_of_squares), the fused optimizers, the
  halo pack and the random flip / rotate transforms, each against the torch code a user
  would write instead, on ResNet-50's parameter shapes (25.6 M elements) and a batch of
  32 x 1 x 64^3 volumes. Median of ``--repeats`` calls, each between
  ``torch.cuda.synchronize()``. The first variant of each op is dataflow's as the
  engine runs it on CUDA: a Numba kernel for pack_scaled_, AdamW and the halo pack
  (the engine's own halo exchange uses torch's copy on CUDA), and torch code where the
  Numba kernel lost: SGD (torch's fused kernel over the flat buffer), sum_of_squares
  (torch's multi-tensor norm), RandomFlip and RandomRotate90 (batch-wide torch calls);
  their labels say so. CUDA only.

The run record holds each workload's sides, its ``ratios`` (``"a / b"``: steady
samples/s of side a over side b), and issue 37's ``targets`` (each with its measured
value and met or not), flattened at the top as ``"<model>: ..."``. ``--budget-s``: no
side starts after that many seconds, nor one that the longest of its model's fits (or
loops) so far says would end after them (skipped sides are recorded); the run so far is
written to ``<out>.partial.json`` after every side, so a killed call leaves its figures.
``--confirm-rounds`` (2): a target whose first value lies within 20% of its bar has its
two sides run again, interleaved, once the first rounds are done; it then reads each
side's median rate and records the ``spread`` of its runs (one ~1 s run of a step bound
by the host varies 20-30% between calls).

    python benchmarks/bench_gpu.py                      # both parts, ~3-4 minutes on an H100
    python benchmarks/bench_gpu.py --part training --models resnet50 cosmoflow
    python benchmarks/bench_gpu.py --device cpu --tiny  # every side at toy sizes, on a CPU

Results are appended to ``benchmarks/results/gpu.json`` (``--out``, ``--overwrite``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_ops_optim import resnet50_shapes
from gpu_device import Device
from gpu_training import Budget, run_training
from gpu_workloads import MODELS, SMALL_FITS, SMALL_LOOPS, classes_data, workloads
from records import RESULTS, machine_info, save_run, table, to_jsonable

NAME = "gpu"
KERNELS_SECONDS = 45  # the kernels part on an H100 (50 repeats), with room to spare


# -- kernels ------------------------------------------------------------------------------


def cuda_median_ms(call: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def cuda_params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=g) * 0.05)
        p.grad = torch.randn(shape, device="cuda", generator=g) * 1e-3
        params.append(p)
    return params


def kernel_groups() -> dict[str, dict[str, Callable[[], Any]]]:
    """{op: {variant: call}}; the first variant of each is dataflow's."""
    from layerwise_torch import TorchLAMB, TorchLARS

    from dataflow.ops import flat, halo
    from dataflow.ops import transforms as T
    from dataflow.ops.layerwise import FusedLAMB, FusedLARS
    from dataflow.ops.optim import FusedAdam, FusedSGD

    shapes = resnet50_shapes()
    grads = [p.grad for p in cuda_params(shapes)]
    n = sum(g.numel() for g in grads)
    bucket = torch.empty(n, device="cuda")
    groups: dict[str, dict[str, Callable[[], Any]]] = {
        "pack_scaled_ (ResNet-50 grads)": {
            "dataflow": lambda: flat.pack_scaled_(bucket, grads, 0.37),
            "torch _foreach_mul + cat": lambda: torch.cat(
                [t.reshape(-1) for t in torch._foreach_mul(grads, 0.37)], out=bucket
            ),
        },
        "sum_of_squares (ResNet-50 grads)": {
            "dataflow (torch _foreach_norm, float64 result)": lambda: flat.sum_of_squares(grads),
            "dataflow's Numba kernel (CPU only since it lost here)": lambda: (
                flat._sum_of_squares_numba(grads, grads[0].device)
            ),
            "torch _foreach_norm": lambda: torch.stack(torch._foreach_norm(grads)).square(),
        },
    }
    optimizers = {
        "SGD momentum (ResNet-50)": (
            lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
            {
                "torch foreach": lambda ps: torch.optim.SGD(
                    ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True
                ),
                "torch fused": lambda ps: torch.optim.SGD(
                    ps, lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True
                ),
            },
        ),
        "AdamW (ResNet-50)": (
            lambda ps: FusedAdam(ps, lr=1e-3),
            {
                "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
                "torch fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
            },
        ),
    }
    lars = dict(lr=1.0, momentum=0.9, weight_decay=1e-4)
    optimizers["LARS (ResNet-50)"] = (
        lambda ps: FusedLARS(ps, **lars),
        {
            "torch foreach": lambda ps: TorchLARS(ps, **lars, foreach=True),
            "torch per-tensor loop": lambda ps: TorchLARS(ps, **lars, foreach=False),
        },
    )
    optimizers["LAMB (ResNet-50)"] = (
        lambda ps: FusedLAMB(ps, lr=1e-3),
        {
            "torch foreach": lambda ps: TorchLAMB(ps, lr=1e-3, foreach=True),
            "torch per-tensor loop": lambda ps: TorchLAMB(ps, lr=1e-3, foreach=False),
        },
    )
    ours_names = {
        "SGD momentum (ResNet-50)": "dataflow (torch _fused_sgd_ on the flat buffer)",
        "AdamW (ResNet-50)": "dataflow",
        "LARS (ResNet-50)": "dataflow (3 Numba launches)",
        "LAMB (ResNet-50)": "dataflow (3 Numba launches)",
    }
    for label, (ours, theirs) in optimizers.items():
        groups[label] = {ours_names[label]: ours(cuda_params(shapes)).step}
        for name, make in theirs.items():
            groups[label][name] = make(cuda_params(shapes)).step

    for shape in ((1, 16, 32, 32, 32), (32, 1, 64, 64, 64), (4, 32, 128, 128, 128)):
        x = torch.randn(shape, device="cuda")
        label = "x".join(map(str, shape))
        groups[f"halo pack, 2 planes of {label}"] = {
            "dataflow": lambda x=x: halo.pack_halo(x, 2, 2, "high"),
            "torch narrow().contiguous()": lambda x=x: x.narrow(2, x.shape[2] - 2, 2).contiguous(),
        }
    volume = torch.randn(32, 1, 64, 64, 64, device="cuda")
    flip = T.RandomFlip(axes=(2, 3, 4))
    rot = T.RandomRotate90(axes=(3, 4))

    def torch_flip() -> torch.Tensor:
        draws = (torch.rand(volume.shape[0], 3) < 0.5).tolist()
        out = volume.clone()
        for i, drawn in enumerate(draws):
            dims = [1 + a for a in range(3) if drawn[a]]  # a sample is (C, D, H, W)
            if dims:
                out[i] = volume[i].flip(dims)
        return out

    def torch_rot() -> torch.Tensor:
        ks = torch.randint(0, 4, (volume.shape[0],)).tolist()
        return torch.stack([torch.rot90(v, k, (2, 3)) for v, k in zip(volume, ks, strict=True)])

    groups["RandomFlip(2,3,4) 32x1x64^3"] = {
        "dataflow (torch where/flip per axis)": lambda: flip(volume, seed=0),
        "torch per-sample flip": torch_flip,
    }
    groups["RandomRotate90(3,4) 32x1x64^3"] = {
        "dataflow (torch rot90 per quarter turn)": lambda: rot(volume, seed=0),
        "torch per-sample rot90": torch_rot,
    }
    return groups


def run_kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for op, variants in kernel_groups().items():
        times = {name: cuda_median_ms(call, args.repeats) for name, call in variants.items()}
        ours = next(iter(times))  # dataflow's variant comes first
        best_torch = min(v for k, v in times.items() if k != ours)
        for name, ms in times.items():
            rows.append(
                {"op": op, "variant": name, "ms": ms, "torch_best_over_this": best_torch / ms}
            )
    print(
        table(
            [
                [r["op"], r["variant"], f"{r['ms']:.3f}", f"{r['torch_best_over_this']:.2f}"]
                for r in rows
            ],
            ["op", "variant", "ms (median)", "best torch / this"],
        )
    )
    return rows


def data(args: argparse.Namespace) -> tuple[Any, Any]:
    """The small CNN's training data (``--samples`` images of ``--image`` px)."""
    return classes_data(args.samples, (3, args.image, args.image), 10)


def commit() -> str | None:
    """The checkout's commit: git's answer, else ``DATAFLOW_COMMIT`` (a copied work tree
    on a GPU node may hold no .git)."""
    return machine_info()["git_commit"] or os.environ.get("DATAFLOW_COMMIT")


def flat(training: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """Every workload's ``key`` entries in one dict, named ``"<workload>: <entry>"``."""
    return {f"{m}: {k}": v for m, out in training.items() for k, v in out.get(key, {}).items()}


def print_targets(found: dict[str, dict[str, Any]]) -> None:
    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows = [
        [
            label,
            show(t["value"]),
            f">= {t['target']}",
            {True: "met", False: "missed", None: "not measured"}[t["met"]],
            show(t.get("ceiling")) if "ceiling_ratio" in t else "",
            "-".join(f"{v:.2f}" for v in t["spread"]) if "spread" in t else "",
        ]
        for label, t in found.items()
    ]
    print(
        table(
            rows,
            ["target (issue 37)", "measured", "target", "", "hand loop's own", "spread of runs"],
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "kernels", "training"], default="all")
    p.add_argument(
        "--models",
        nargs="*",
        default=list(MODELS),
        choices=MODELS,
        help="training workloads, run in this order (small resnet50 cosmoflow)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="(cuda)")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="every workload and side at toy sizes, compiled sides left out: the CPU smoke run",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no side after this many seconds; the rest are recorded as skipped",
    )
    p.add_argument("--repeats", type=int, default=50, help="timed calls per kernel (50)")
    p.add_argument(
        "--confirm-rounds",
        type=int,
        default=2,
        help="more runs of the two sides of each target whose first value lies within 20%% "
        "of its bar, interleaved, before the sides outside the first rounds; the targets "
        "then read each side's median (2)",
    )
    p.add_argument("--image", type=int, default=64, help="small CNN: image side (64)")
    p.add_argument("--batch", type=int, default=256, help="small CNN: global batch (256)")
    p.add_argument("--samples", type=int, default=8192, help="small CNN: samples (8192)")
    p.add_argument("--epochs", type=int, default=12, help="small CNN: epochs (12)")
    p.add_argument("--warmup", type=int, default=16, help="small CNN: steps left out (16)")
    p.add_argument(
        "--fits",
        nargs="*",
        default=list(SMALL_FITS),
        choices=list(SMALL_FITS),
        help="small CNN: Pipeline.fit variants to time (all)",
    )
    p.add_argument(
        "--loops",
        nargs="*",
        default=list(SMALL_LOOPS),
        choices=list(SMALL_LOOPS),
        help="small CNN: hand-written loop variants to time (all)",
    )
    p.add_argument("--out", default=None, help="JSON path (default results/gpu.json)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier runs in --out")
    args = p.parse_args()
    device = Device(args.device)
    if device.cuda and not torch.cuda.is_available():
        raise SystemExit(
            "bench_gpu needs a CUDA GPU (torch.cuda.is_available() is False); "
            "`--device cpu --tiny` runs every training side on the CPU at toy sizes"
        )
    if not device.cuda:  # as the fit's one-thread worker; idle OpenMP threads spin
        torch.set_num_threads(1)
    run: dict[str, Any] = {
        "commit": commit(),
        "gpu": device.name(),
        "torch": torch.__version__,
        "args": vars(args),
    }
    partial = Path(args.out or RESULTS / f"{NAME}.json").with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def saved() -> None:  # the run so far, for a call killed before its end
        run["seconds"] = round(time.perf_counter() - started, 1)
        partial.write_text(json.dumps(to_jsonable(run), indent=1))

    saved()
    budget = Budget(args.budget_s)
    if args.part in ("all", "training"):
        run["training"] = {}
        run_training(workloads(args), device, budget, run["training"], saved, args.confirm_rounds)
        run["ratios"] = flat(run["training"], "ratios")
        run["targets"] = flat(run["training"], "targets")
        print_targets(run["targets"])
    if args.part in ("all", "kernels"):
        if not device.cuda:
            run["kernels"] = {"skipped": "CUDA only"}
        elif budget.spent(needing=KERNELS_SECONDS):
            run["kernels"] = {"skipped": f"under {KERNELS_SECONDS} s of --budget-s were left"}
        else:
            run["kernels"] = run_kernels(args)
    run["seconds"] = round(time.perf_counter() - started, 1)
    print("saved", save_run(NAME, run, args.out, overwrite=args.overwrite))
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
