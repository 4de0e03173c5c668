"""The data-path ops (``dataflow.ops.transforms``) against their torch equivalents, on CPU.

Both sides get the same threads (``torch.set_num_threads`` = ``numba.set_num_threads``
= ``--threads``), the same inputs and, for the random ops, the same per-sample choices
(drawn inside the timed call on both sides). The sides' calls are interleaved, after
waiting for a quiet machine; CPU used meanwhile by other programs is reported as
``foreign cores`` and a workload it disturbed is rerun (``--retries``). Both sides
allocate their outputs with torch as users get them: a 3D batch (32 MiB) is a fresh
mmap from glibc, whose first-touch page faults cost more than the kernels' own work;
under ``THP_MEM_ALLOC_ENABLE=1`` torch allocates large tensors on transparent huge pages
(both sides), which mostly leaves the kernels. Per op and workload:

* numba: the op, which writes the output dtype directly (cast fused);
* torch: the plain torch expression followed by ``.to(dtype)``: ``torch.log1p(x * s)``,
  ``(x - mean) / std`` broadcast, per-sample ``torch.flip`` / ``torch.rot90`` + stack;
* torch grouped (random ops): the best vectorised torch found: the samples sharing a
  choice are gathered, flipped/rotated together and scattered back (``index_select``,
  ``flip``/``rot90``, ``index_copy_``): at most 2^axes (flip) or 4 (rotate) groups.

Reported: median milliseconds over ``--repeats`` after ``--warmup`` calls per side
(numba compiles there; on a VM, memory first touched since boot is slow to back), GB/s
as (input + output bytes) / median time, and the ratio torch / numba (> 1: numba
faster). Every output is checked equal to torch's before timing. Results are appended
to ``benchmarks/results/ops_transforms.json`` (``--out``, ``--overwrite``).

    python benchmarks/bench_ops_transforms.py                # all usable cores
    python benchmarks/bench_ops_transforms.py --threads 1
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/bench_ops_transforms.py  # huge pages, both sides
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch
from quiet import wait_quiet
from records import save_run, table

from dataflow.ops import transforms as T
from dataflow.tools.cpu_meter import CpuMeter

NAME = "ops_transforms"
SEED = (0, 1, 0)  # what stages.Transform passes: (fit seed, step, replica rank)
SHAPES = {"3D": (32, 1, 64, 64, 64), "2D": (256, 3, 64, 64)}
# (input dtype, output dtype): the training dtype is float32
CASTS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float32),
    (torch.float16, torch.float32),
]


def time_ms(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Milliseconds per call, the sides interleaved (a disturbance hits all of them)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def flip_per_sample(x: torch.Tensor, axes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    flags = T.draw_flips(len(x), len(axes), 0.5, SEED)
    samples = [
        x[n].flip([a - 1 for a, f in zip(axes, flags[n], strict=True) if f]) for n in range(len(x))
    ]
    return torch.stack(samples).to(dtype)


def flip_grouped(x: torch.Tensor, axes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    flags = T.draw_flips(len(x), len(axes), 0.5, SEED)
    codes = flags @ (1 << np.arange(len(axes)))
    out = torch.empty(x.shape, dtype=dtype)
    for code in np.unique(codes):
        index = torch.from_numpy(np.flatnonzero(codes == code))
        dims = [a for i, a in enumerate(axes) if code >> i & 1]
        part = x.index_select(0, index)
        out.index_copy_(0, index, (part.flip(dims) if dims else part).to(dtype))
    return out


def rot_per_sample(x: torch.Tensor, axes: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    ks = T.draw_rotations(len(x), SEED)
    dims = (axes[0] - 1, axes[1] - 1)
    return torch.stack([torch.rot90(x[n], int(ks[n]), dims) for n in range(len(x))]).to(dtype)


def rot_grouped(x: torch.Tensor, axes: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    ks = T.draw_rotations(len(x), SEED)
    out = torch.empty(x.shape, dtype=dtype)
    for k in np.unique(ks):
        index = torch.from_numpy(np.flatnonzero(ks == k))
        part = torch.rot90(x.index_select(0, index), int(k), axes)
        out.index_copy_(0, index, part.to(dtype))
    return out


def workloads(shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, Any, dict]]:
    """(op label, the op as called, {baseline label: torch function})."""
    channels, spatial = shape[1], tuple(range(2, len(shape)))
    mean = tuple(0.1 * (c + 1) for c in range(channels))
    std = tuple(0.5 * (c + 1) for c in range(channels))
    view = (1, channels) + (1,) * (len(shape) - 2)
    m, s = torch.tensor(mean).reshape(view), torch.tensor(std).reshape(view)
    rot_axes = spatial[-2:]  # (H, W): the plane that needs a transpose
    log1p, standardize = (
        T.Log1p(scale=0.5, dtype=dtype),
        T.Standardize(mean=mean, std=std, dtype=dtype),
    )
    flip = T.RandomFlip(axes=spatial, dtype=dtype)
    rot = T.RandomRotate90(axes=rot_axes, dtype=dtype)
    return [
        ("Log1p", log1p, {"torch": lambda x: torch.log1p(x * 0.5).to(dtype)}),
        ("Standardize", standardize, {"torch": lambda x: ((x - m) / s).to(dtype)}),
        (
            f"RandomFlip{spatial}",
            lambda x: flip(x, seed=SEED),
            {
                "torch per-sample": lambda x: flip_per_sample(x, spatial, dtype),
                "torch grouped": lambda x: flip_grouped(x, spatial, dtype),
            },
        ),
        (
            f"RandomRotate90{rot_axes}",
            lambda x: rot(x, seed=SEED),
            {
                "torch per-sample": lambda x: rot_per_sample(x, rot_axes, dtype),
                "torch grouped": lambda x: rot_grouped(x, rot_axes, dtype),
            },
        ),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, default=cores, help=f"torch = numba threads ({cores})")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per side (15)")
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="untimed calls per side first (5): compiled kernels, allocator and page pools warm",
    )
    p.add_argument("--shapes", default="3D,2D", help="workloads: 3D (32,1,64^3), 2D (256,3,64^2)")
    p.add_argument(
        "--max-wait",
        type=float,
        default=60.0,
        help="seconds to wait for a quiet machine before each workload (60)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="reruns of a workload disturbed by other programs on the machine (2)",
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="cores used by other programs during a workload above which it is rerun (0.1)",
    )
    p.add_argument("--out", help="JSON file (default benchmarks/results/ops_transforms.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file instead of appending")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)

    rows, records = [], []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        base = torch.from_numpy(np.random.default_rng(0).uniform(0, 10, size=shape))
        for dtype_in, dtype in CASTS:
            x = base.to(dtype_in)
            for label, op, baselines in workloads(shape, dtype):
                ours = op(x)  # numba compiles here
                for fn in baselines.values():  # same result (torch's float16 math is coarser)
                    torch.testing.assert_close(ours, fn(x), **TOL[dtype_in])
                sides = {"numba": lambda op=op, x=x: op(x)}
                sides |= {name: lambda fn=fn, x=x: fn(x) for name, fn in baselines.items()}
                time_ms(sides, args.warmup)
                attempts = 0
                while True:  # rerun what other programs disturbed
                    attempts += 1
                    wait_quiet(args.max_wait)
                    with CpuMeter() as meter:
                        times = time_ms(sides, args.repeats)
                    foreign = meter.foreign_cpu_seconds / meter.wall_seconds
                    if foreign <= args.max_foreign or attempts > args.retries:
                        break
                median = {k: statistics.median(v) for k, v in times.items()}
                nbytes = x.nbytes + ours.nbytes
                cast = f"{str(dtype_in)[6:]}->{str(dtype)[6:]}"
                record = {
                    "op": label,
                    "shape": list(shape),
                    "cast": cast,
                    "bytes": nbytes,
                    "median_ms": median,
                    "times_ms": times,
                    "ratio": {k: v / median["numba"] for k, v in median.items() if k != "numba"},
                    "foreign_cores": foreign,
                    "attempts": attempts,
                }
                records.append(record)
                for name in baselines:
                    rows.append(
                        [
                            label,
                            shape_name,
                            cast,
                            f"{median['numba']:.2f}",
                            f"{nbytes / median['numba'] / 1e6:.1f}",
                            name,
                            f"{median[name]:.2f}",
                            f"{nbytes / median[name] / 1e6:.1f}",
                            f"{record['ratio'][name]:.2f}x",
                            f"{record['foreign_cores']:.2f}",
                        ]
                    )
                    print("  " + "  ".join(rows[-1]), flush=True)
    print()
    print(f"threads: torch {torch.get_num_threads()}, numba {numba.get_num_threads()}")
    print(table(rows, HEADER))
    worst = min(r["ratio"][k] for r in records for k in r["ratio"])
    print(f"lowest ratio torch/numba: {worst:.2f}x (target >= 1.0x)")
    print(
        f"foreign cores: CPU used by other programs meanwhile (> {args.max_foreign}: a "
        f"disturbed figure, kept after {args.retries} reruns)"
    )
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
    run = {"args": vars(args), "threads": args.threads, "thp_mem_alloc_enable": thp}
    run["results"] = records
    print(f"saved to {save_run(NAME, run, args.out, overwrite=args.overwrite)}")


HEADER = [
    "op",
    "data",
    "cast",
    "numba ms",
    "GB/s",
    "baseline",
    "torch ms",
    "GB/s",
    "torch/numba",
    "foreign cores",
]
TOL = {  # numba vs torch outputs, by input dtype
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.float64: {"rtol": 1e-6, "atol": 1e-6},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


if __name__ == "__main__":
    main()
