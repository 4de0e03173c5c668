"""Against the peer: dataflow with 2 replicas vs torch DistributedDataParallel, 2 processes.

Both sides: the same CNN and initial weights, the same in-memory data, the same global
batches in the same order, each of the 2 ranks taking half of every global batch
(``dataflow.schedule.balance.Even``), SGD with momentum, one torch thread per rank, gloo, and
nothing else running (the sides run one after the other).

* DDP: ``torch.multiprocessing.spawn`` of 2 processes, ``init_process_group("gloo")``,
  ``DistributedDataParallel(model)`` with its defaults; data indexed in the loop.
* dataflow: ``Pipeline.fit(replicas=2)`` on a ``LocalCluster(n_workers=2,
  threads_per_worker=1, processes=True)`` started before the fit.

Throughput in steady state: the first ``--warmup`` steps, rounded up to the end of a
dataflow window, are excluded on both sides; dataflow is timed on the driver (arrival of
window results, Dask gaps included), DDP on rank 0 (ranks are in lockstep). Also printed:
the DDP step time (the CNN must make a step take >= 50 ms), dataflow's per-stage time
split, and the Dask scheduling share ``1 - task_seconds[r] / phase seconds``.

Each side waits for a quiet machine first and is rerun when other programs used more
than ``--max-foreign`` cores meanwhile (measured from /proc/stat minus this process
tree); the per-process/per-thread CPU use in steady training is printed for both sides.
Results are appended to ``benchmarks/results/<name>.json`` (``--out``, ``--overwrite``).
The ``--worker-*`` and baseline malloc switches are for diagnosis; their defaults are
what a user gets.

    python benchmarks/bench_ddp.py                   # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from baseline import planned_batches, timed_steps
from cli_args import add_quiet_args, add_worker_args, add_workload_args
from engine_run import run_fit
from measure import median, print_gc, scheduling_share, steady_boundary, steady_fit, steady_loop
from processes import SINGLE_THREAD_ENV, START_ENV, environment, pin_process
from quiet import measure_side, print_threads
from records import save_run, table
from workloads import (
    CNNConfig,
    ModelFactory,
    OptimConfig,
    OptimizerFactory,
    Workload,
    make_data,
    parameter_count,
)

from dataflow.runtime.malloc import relax_malloc

NAME = "bench_ddp"
WORLD = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(p, samples=1024, epochs=8, channels="32,64,128", convs=2, hidden=256)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="dataflow AllReduce bucket_mb")
    p.add_argument(
        "--order",
        choices=("ddp-first", "dataflow-first"),
        default="ddp-first",
        help="which side runs first (they never run concurrently)",
    )
    add_worker_args(p)
    p.add_argument(
        "--ddp-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for the DDP processes (diagnosis), repeatable",
    )
    p.add_argument(
        "--ddp-malloc",
        choices=("default", "mallopt"),
        default="default",
        help="mallopt: the DDP ranks call the same glibc mallopt() as --worker-malloc-trim "
        "mallopt (diagnosis)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin DDP rank i and dataflow worker i (all threads) to core i (diagnosis)",
    )
    add_quiet_args(p)
    p.add_argument("--out", help="JSON file (default benchmarks/results/bench_ddp.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file instead of appending")
    return p.parse_args(argv)


# -- the DDP side ----------------------------------------------------------------------


def ddp_rank(
    rank: int, work: Workload, init_file: str, out_dir: str, relax: bool, pin: bool
) -> None:
    """One DDP process: the global batches of ``work``, this rank's half of each."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dataflow.schedule.balance import Even

    if relax:
        relax_malloc()
    if pin:
        pin_process(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    x_np, y_np = make_data(work.samples, work.model, work.seed)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    torch.manual_seed(work.seed)
    model = DistributedDataParallel(ModelFactory(work.model)().train())
    optimizer = OptimizerFactory(work.optim)(model.parameters())
    split = Even().split
    batches = planned_batches(work, WORLD)
    dist.barrier()
    steps = timed_steps(model, optimizer, x, y, batches, lambda parts: parts[rank])
    dist.barrier()
    result = {
        "rank": rank,
        "torch_threads": torch.get_num_threads(),
        "total_seconds": time.perf_counter() - steps["started"],
        "load_seconds": steps["loads"],
        "step_seconds": steps["seconds"],
        "ends": steps["ends"],
        "samples": steps["samples"],
        "losses": torch.stack(steps["losses"]).tolist(),
        "local_batches": [
            split(min(work.batch, work.samples - s * work.batch), WORLD)[rank]
            for s in range(work.steps_per_epoch)
        ],
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_ddp(work: Workload, env: dict[str, str], relax: bool, pin: bool) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory() as tmpdir, environment({**START_ENV, **env}):
        tmp.spawn(
            ddp_rank, args=(work, str(Path(tmpdir, "init")), tmpdir, relax, pin), nprocs=WORLD
        )
        ranks = [json.loads(Path(tmpdir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    # the global loss of a step: the local means weighted by the local batch sizes
    weights = [r["local_batches"] for r in ranks]
    per_epoch = len(weights[0])
    losses = []
    for i in range(len(ranks[0]["losses"])):
        b = [w[i % per_epoch] for w in weights]
        losses.append(sum(r["losses"][i] * n for r, n in zip(ranks, b, strict=True)) / sum(b))
    return {"ranks": ranks, "losses": losses}


# -- the comparison --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = CNNConfig(
        image=args.image,
        channels=tuple(int(c) for c in args.channels.split(",")),
        convs_per_stage=args.convs,
        hidden=args.hidden,
    )
    work = Workload(
        model=model,
        samples=args.samples,
        batch=args.batch,
        epochs=args.epochs,
        seed=args.seed,
        optim=OptimConfig(lr=args.lr, momentum=args.momentum),
    )
    ddp_env = dict(SINGLE_THREAD_ENV)
    ddp_env.update(kv.split("=", 1) for kv in args.ddp_env)
    n_params = parameter_count(model)
    print(
        f"{NAME}: CNN {model.channels} x{model.convs_per_stage} ({n_params} params, "
        f"{n_params * 4 / 2**20:.1f} MiB of gradients), {work.samples} samples "
        f"{model.in_channels}x{model.image}x{model.image}, global batch {work.batch} "
        f"({work.batch // WORLD} per rank), {work.epochs} epochs = {work.steps} steps, "
        f"{WORLD} ranks x 1 thread"
    )
    runners = {
        "ddp": lambda: run_ddp(work, ddp_env, args.ddp_malloc == "mallopt", args.pin),
        "dataflow": lambda: run_fit(
            work,
            replicas=WORLD,
            window_seconds=args.window_seconds,
            malloc_trim=args.worker_malloc_trim,
            worker_profile=args.worker_profile == "on",
            engine_relax_malloc=args.engine_relax_malloc == "on",
            gc_freeze=args.worker_gc_freeze,
            pin=args.pin,
            bucket_mb=args.bucket_mb,
        ),
    }
    sides: dict[str, Any] = {}
    quiet: dict[str, Any] = {}
    for side in ("ddp", "dataflow") if args.order == "ddp-first" else ("dataflow", "ddp"):
        sides[side], quiet[side] = measure_side(
            side,
            runners[side],
            retries=args.retries,
            max_wait=args.max_wait,
            max_foreign=args.max_foreign,
        )
    ddp, fit = sides["ddp"], sides["dataflow"]
    rank0 = ddp["ranks"][0]
    history = fit["history"]
    steps, phase = history["steps"], history["phases"][0]
    if len(steps) != len(rank0["ends"]):
        raise RuntimeError(f"dataflow ran {len(steps)} steps, DDP {len(rank0['ends'])}")

    first = steady_boundary(steps, args.warmup)
    samples_per_step = [s["samples"] for s in steps]
    steady_df = steady_fit(steps, first)
    steady_ddp = steady_loop(rank0["ends"], samples_per_step, first)
    ddp_step = median(rank0["step_seconds"][first:])
    df_step = median([s["seconds"] for s in steps[first:]])
    ratio = steady_df.samples_per_second / steady_ddp.samples_per_second
    loss_diff = max(
        abs(a - b) for a, b in zip((s["loss"] for s in steps), ddp["losses"], strict=True)
    )
    shares = [scheduling_share(phase, r) for r in range(WORLD)]

    rows = [
        [
            "torch DDP (gloo)",
            f"{steady_ddp.samples_per_second:.1f}",
            f"{ddp_step * 1e3:.1f}",
            f"{sum(samples_per_step) / rank0['total_seconds']:.1f}",
        ],
        [
            "dataflow fit",
            f"{steady_df.samples_per_second:.1f}",
            f"{df_step * 1e3:.1f}",
            f"{sum(samples_per_step) / history['info']['train_seconds']:.1f}",
        ],
    ]
    print(table(rows, ["side", "steady samples/s", "median step ms", "whole-run samples/s"]))
    print(
        f"steady state: steps {first}..{len(steps) - 1} ({steady_df.steps} steps, "
        f"{steady_df.samples} samples); dataflow windows: {phase['windows']}"
    )
    if ddp_step < 0.05:
        print(f"WARNING: the DDP step takes {ddp_step * 1e3:.1f} ms < 50 ms; use a larger CNN")
    print(f"ratio dataflow/DDP (steady samples/s): {ratio:.4f}  (target >= 1.0)")

    stage_rows, stage_share = [], []
    for r in range(WORLD):
        stages = phase["stage_seconds"][r]
        task = phase["task_seconds"][r]
        share = {k: v / task for k, v in stages.items()}
        share["(outside stages)"] = 1.0 - sum(stages.values()) / task
        stage_share.append(share)
    names = list(stage_share[0])
    for name in names:
        stage_rows.append(
            [name]
            + [f"{phase['stage_seconds'][r].get(name, 0.0):.2f}" for r in range(WORLD)]
            + [f"{stage_share[r][name] * 100:.1f}" for r in range(WORLD)]
        )
    header = ["stage", *(f"r{r} s" for r in range(WORLD)), *(f"r{r} %" for r in range(WORLD))]
    print(table(stage_rows, header))
    gaps = fit["gaps"]
    print(
        "Dask scheduling share (1 - task_seconds/phase seconds): "
        + ", ".join(f"replica {r} {shares[r] * 100:.3f} %" for r in range(WORLD))
        + "  (target < 1 %)"
    )
    print(
        "worker idle between windows (Dask round trip), median: "
        + ", ".join(
            f"replica {r} {g['median_train_window_gap_seconds'] * 1e3:.2f} ms"
            for r, g in enumerate(gaps)
        )
    )
    print(
        "cores used by other programs meanwhile (should be ~0): "
        + ", ".join(f"{k} {q['attempts'][-1]['foreign_cores']:.3f}" for k, q in quiet.items())
        + f"; dataflow workers: {', '.join(fit['worker_env'])} "
        f"(--worker-malloc-trim {args.worker_malloc_trim}, "
        f"--engine-relax-malloc {args.engine_relax_malloc}, "
        f"--worker-gc-freeze {args.worker_gc_freeze}, "
        f"--worker-profile {args.worker_profile}, --ddp-malloc {args.ddp_malloc}, "
        f"--pin {args.pin})"
    )
    print_gc(fit)
    print_threads(quiet)
    if any(q["disturbed"] for q in quiet.values()):
        print("WARNING: a side was disturbed by other programs; its figures are not comparable")
    print(
        f"DDP median load (index_select) per step: "
        f"{median(rank0['load_seconds'][first:]) * 1e3:.3f} ms; "
        f"max |global loss difference| over all steps: {loss_diff:.3g}"
    )

    run = {
        "args": vars(args),
        "workload": work,
        "ddp_env": ddp_env,
        "steady": {
            "first_step": first,
            "steps": steady_df.steps,
            "samples": steady_df.samples,
            "dataflow_seconds": steady_df.seconds,
            "ddp_seconds": steady_ddp.seconds,
            "dataflow_samples_per_second": steady_df.samples_per_second,
            "ddp_samples_per_second": steady_ddp.samples_per_second,
        },
        "ratio_dataflow_over_ddp": ratio,
        "target_ratio": 1.0,
        "ddp_median_step_seconds": ddp_step,
        "dataflow_median_step_seconds": df_step,
        "scheduling_share": shares,
        "target_scheduling_share": 0.01,
        "stage_share_of_task": stage_share,
        "dataflow": {
            "train_seconds": history["info"]["train_seconds"],
            "fit_seconds": history["info"]["fit_seconds"],
            "fit_call_seconds": fit["fit_call_seconds"],
            "phase": phase,
            "workers": history["info"]["workers"],
            "step_seconds": [s["seconds"] for s in steps],
            "step_times": [s["time"] for s in steps],
            "worker_gaps": gaps,
        },
        "ddp": {
            "total_seconds": [r["total_seconds"] for r in ddp["ranks"]],
            "torch_threads": [r["torch_threads"] for r in ddp["ranks"]],
            "median_load_seconds": [median(r["load_seconds"][first:]) for r in ddp["ranks"]],
            "step_seconds": rank0["step_seconds"],
        },
        "max_abs_loss_difference": loss_diff,
        "quiet": quiet,
        "disturbed": any(q["disturbed"] for q in quiet.values()),
        "worker_env": fit["worker_env"],
        "worker_gc": fit["worker_gc"],
    }
    path = save_run(NAME, run, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return run


if __name__ == "__main__":
    main()
