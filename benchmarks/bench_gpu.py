"""On one CUDA GPU: dataflow's ops against torch, and a one-replica fit against a
hand-written torch loop.

Needs a CUDA GPU (exits with a message otherwise). Two parts, each side timed in the
same run, ratios printed:

* ``kernels``: ``ops.flat`` (pack_scaled_, sum_of_squares), the fused optimizers, the
  halo pack and the random flip / rotate transforms, each against the torch code a user
  would write instead, on ResNet-50's parameter shapes (25.6 M elements) and a batch of
  32 x 1 x 64^3 volumes. Median of ``--repeats`` calls, each between
  ``torch.cuda.synchronize()``. The first variant of each op is dataflow's as the
  engine runs it on CUDA: a Numba kernel for pack_scaled_, AdamW and the halo pack
  (the engine's own halo exchange uses torch's copy on CUDA), and torch code where the
  Numba kernel lost: SGD (torch's fused kernel over the flat buffer), sum_of_squares
  (torch's multi-tensor norm), RandomFlip and RandomRotate90 (batch-wide torch calls);
  their labels say so.
* ``training``: a CNN (``--image`` px, ``--batch``) trained for ``--epochs`` by
  ``Pipeline.fit(replicas=1, device="cuda")`` on a one-worker LocalCluster (data from
  memory, and streamed from a zarr store through pinned host buffers), against the same
  steps in a plain torch loop (host batches pinned and copied ``non_blocking``) and a
  loop whose data already sits on the GPU (the upper bound). Steady state: the first
  ``--warmup`` steps (rounded to a dataflow window) are left out of both.

    python benchmarks/bench_gpu.py                      # both parts, ~3 minutes on an H100
    python benchmarks/bench_gpu.py --part kernels

Results are appended to ``benchmarks/results/gpu.json`` (``--out``, ``--overwrite``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from bench_ops_optim import resnet50_shapes
from measure import steady_boundary, steady_fit
from records import machine_info, save_run, table

NAME = "gpu"


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
    from dataflow.ops import flat, halo
    from dataflow.ops import transforms as T
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
    ours_names = {
        "SGD momentum (ResNet-50)": "dataflow (torch _fused_sgd_ on the flat buffer)",
        "AdamW (ResNet-50)": "dataflow",
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


# -- training -------------------------------------------------------------------------------


class GpuNet(torch.nn.Module):
    """conv-BN-ReLU stages, strided, global pooling: enough work per step for a GPU."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        c = 3
        for w in (width, 2 * width, 4 * width, 8 * width):
            layers += [
                torch.nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False),
                torch.nn.BatchNorm2d(w),
                torch.nn.ReLU(),
                torch.nn.Conv2d(w, w, 3, padding=1, bias=False),
                torch.nn.BatchNorm2d(w),
                torch.nn.ReLU(),
            ]
            c = w
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def data(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 3, args.image, args.image), dtype=np.float32)
    return x, rng.integers(0, 10, size=args.samples).astype(np.int64)


LOOP_VARIANTS: dict[str, dict[str, Any]] = {
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


def plain_loop(
    args: argparse.Namespace,
    batches: list[np.ndarray],
    resident: bool,
    bf16: bool = False,
    channels_last: bool = False,
    compile: bool = False,
    synced: bool = False,
) -> tuple[list[float], float]:
    """Step end times of the hand-written loop over the fit's own batches, and the
    seconds its first step took (compilation included when ``compile``).

    Unless ``synced``, the host never waits for the GPU inside the loop: the sample
    indices are uploaded before the clock starts, and each step's end is a CUDA event
    read after the last step. ``synced`` uploads each step's indices from pageable
    memory and synchronizes after every step: the host's launch time then adds to the
    GPU's instead of overlapping it, which flattered the fit in earlier runs."""
    x_np, y_np = data(args)
    torch.manual_seed(0)
    model = GpuNet().cuda().train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = sgd(model.parameters())
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    if resident:
        x, y = x.cuda(), y.cuda()
    indices = [torch.from_numpy(index) for index in batches]
    if not synced:
        indices = [index.to(x.device) for index in indices]

    def forward_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            return F.cross_entropy(model(xb), yb)

    step_loss = torch.compile(forward_loss) if compile else forward_loss
    started = torch.cuda.Event(enable_timing=True)
    step_ends = []
    torch.cuda.synchronize()
    started.record()
    for index in indices:
        idx = index.to(x.device)
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        if not resident:
            xb = xb.pin_memory().cuda(non_blocking=True)
            yb = yb.pin_memory().cuda(non_blocking=True)
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        loss = step_loss(xb, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_ends.append(torch.cuda.Event(enable_timing=True))
        step_ends[-1].record()
        if synced:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    ends = [started.elapsed_time(end) / 1000 for end in step_ends]
    return ends, ends[0]


FIT_VARIANTS: dict[str, dict[str, Any]] = {
    # name: (source, Pipeline step options); "auto" is bf16 + channels_last on an H100
    "dataflow_memory_fp32": {"source": "memory", "precision": "fp32", "channels_last": False},
    "dataflow_memory": {"source": "memory"},  # uploaded to the GPU once (data_on_device)
    "dataflow_memory_host": {"source": "memory", "data_on_device": False},
    "dataflow_zarr": {"source": "zarr"},
    "dataflow_memory_compiled": {"source": "memory", "compile": True},
    # the noise-scale auto-tuner measuring but never growing: its cost per step (item 7)
    "dataflow_memory_adaptive": {"source": "memory", "schedule": "adaptive"},
}


def fit(
    args: argparse.Namespace, source: Any, client: Any, schedule: str = "fixed", **options: Any
) -> Any:
    import dataflow as dfl

    if schedule == "adaptive":  # one phase at the fixed batch: only the measurement differs
        chosen = dfl.schedule.Adaptive(
            args.batch, max_batch=args.batch, epochs_per_phase=args.epochs
        )
    else:
        chosen = dfl.schedule.Fixed(args.batch)
    pipe = dfl.Pipeline(
        model=GpuNet,
        loss=F.cross_entropy,
        optimizer=sgd,
        source=source,
        schedule=chosen,
        device="cuda",
        replicas=1,
        progress=False,
        **options,
    )
    return pipe, pipe.fit(epochs=args.epochs, client=client)


def run_training(args: argparse.Namespace) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    import dataflow as dfl

    x, y = data(args)
    out: dict[str, Any] = {"image": args.image, "batch": args.batch, "samples": args.samples}
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, dashboard_address=":0", silence_logs=logging.ERROR
        ) as cluster,
        Client(cluster) as client,
        tempfile.TemporaryDirectory() as tmp,
    ):
        dfl.io.to_zarr(f"{tmp}/train.zarr", x, y)
        sources = {
            "memory": dfl.io.ArraySource(x, y),
            "zarr": dfl.io.ZarrSource(f"{tmp}/train.zarr", y="y"),
        }
        plan_pipe = None  # a Fixed fit's pipeline: the hand loops train on its sample plan
        for name, variant in FIT_VARIANTS.items():
            if name not in args.fits:
                continue
            options = {k: v for k, v in variant.items() if k != "source"}
            try:
                pipe, result = fit(args, sources[variant["source"]], client, **options)
            except Exception as error:  # one broken side must not cost the others' figures
                print(f"{name}: failed: {type(error).__name__}: {error}")
                out[name] = {"error": f"{type(error).__name__}: {error}"}
                continue
            plan_pipe = plan_pipe if variant.get("schedule") else pipe
            steps = result.history.steps
            first = steady_boundary(steps, args.warmup)
            steady = steady_fit(steps, first)
            worker = result.history.info["workers"][0]
            phase = result.history.phases[0]
            out[name] = {
                "samples_per_s": steady.samples_per_second,
                "first_step": first,
                "device": worker.get("device"),
                "step_options": {
                    k: worker.get(k) for k in ("precision", "memory_format", "compile")
                },
                "compile_seconds": phase.compile_seconds,
                "compiled_shapes": phase.compiled_shapes,
                # the replica's host time per step in each stage (the whole fit): where a
                # host-bound fit's time goes, without a profiler
                "host_ms_per_step": {
                    stage: round(1000 * seconds / phase.steps, 3)
                    for stage, seconds in phase.stage_seconds[0].items()
                },
            }
            print(f"{name}: host ms per step by stage: {out[name]['host_ms_per_step']}")
        batches = [
            np.concatenate(parts) for parts in plan_pipe.sample_plan(epochs=args.epochs, replicas=1)
        ]
    for name, options in LOOP_VARIANTS.items():
        if name not in args.loops:
            continue
        ends, first_step_s = plain_loop(args, batches, **options)
        first = next(
            v["first_step"] for v in out.values() if isinstance(v, dict) and "first_step" in v
        )
        samples = sum(len(b) for b in batches[first:])
        out[name] = {
            "samples_per_s": samples / (ends[-1] - ends[first - 1]),
            "first_step_s": first_step_s,
        }
    base = out.get("torch_loop_resident", {}).get("samples_per_s", float("nan"))
    rows = [
        [k, f"{v['samples_per_s']:.0f}", f"{v['samples_per_s'] / base:.3f}"]
        for k, v in out.items()
        if isinstance(v, dict) and "samples_per_s" in v
    ]
    print(table(rows, ["side", "samples/s (steady)", "vs torch loop (resident, fp32)"]))
    same_settings = {  # each fit against the hand loop with its settings
        "dataflow_memory_fp32": "torch_loop_resident",
        "torch_loop_resident_synced": "torch_loop_resident",
        "dataflow_memory": "torch_loop_resident_bf16_cl",
        "dataflow_memory_host": "torch_loop_resident_bf16_cl",
        "dataflow_zarr": "torch_loop_resident_bf16_cl",
        "dataflow_memory_compiled": "torch_loop_resident_bf16_cl_compiled",
        "dataflow_memory_adaptive": "dataflow_memory",
    }
    out["ratios"] = {
        f"{fit_side} / {loop}": out[fit_side]["samples_per_s"] / out[loop]["samples_per_s"]
        for fit_side, loop in same_settings.items()
        if "samples_per_s" in out.get(fit_side, {}) and "samples_per_s" in out.get(loop, {})
    }
    for label, ratio in out["ratios"].items():
        print(f"{label}: {ratio:.3f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "kernels", "training"], default="all")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per kernel (50)")
    p.add_argument("--image", type=int, default=64, help="training image side (64)")
    p.add_argument("--batch", type=int, default=256, help="global batch (256)")
    p.add_argument("--samples", type=int, default=8192, help="training samples (8192)")
    p.add_argument("--epochs", type=int, default=12, help="training epochs (12)")
    p.add_argument("--warmup", type=int, default=16, help="steps left out of the rate (16)")
    p.add_argument(
        "--fits",
        nargs="*",
        default=list(FIT_VARIANTS),
        choices=list(FIT_VARIANTS),
        help="Pipeline.fit variants to time (all)",
    )
    p.add_argument(
        "--loops",
        nargs="*",
        default=list(LOOP_VARIANTS),
        choices=list(LOOP_VARIANTS),
        help="hand-written loop variants to time (all)",
    )
    p.add_argument("--out", default=None, help="JSON path (default results/gpu.json)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier runs in --out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    run: dict[str, Any] = {
        "machine": machine_info(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args),
    }
    if args.part in ("all", "kernels"):
        run["kernels"] = run_kernels(args)
    if args.part in ("all", "training"):
        run["training"] = run_training(args)
    print("saved", save_run(NAME, run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
