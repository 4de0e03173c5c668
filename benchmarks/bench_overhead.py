"""Engine overhead: a 1-replica dataflow fit vs the same training as a plain torch loop.

Both sides: the same CNN and initial weights, the same in-memory data, the same global
batches in the same order (``dataflow.io.replica_streams``), SGD with momentum, one torch
thread, and nothing else running (the sides run one after the other).

* hand loop: a spawned process with ``torch.set_num_threads(1)`` (and OMP/MKL = 1).
* dataflow: ``Pipeline.fit`` on a ``LocalCluster(n_workers=1, threads_per_worker=1,
  processes=True)`` started before the fit (cluster start-up is not counted).

Primary figure, time per sample in steady state: warm-up is the first ``--warmup`` steps
rounded up to the end of a dataflow window (the 2 calibration steps, and the first fused
window when ``--warmup`` reaches into it). The *same* steps are excluded from the hand
loop. dataflow is timed on the driver, from the arrival of the last warm-up window's
results to the arrival of the last window's (so Dask scheduling gaps between windows are
counted); the hand loop from the end of the same warm-up step to the end of its last step.
Also reported: the whole run (``train_seconds`` vs the whole loop, warm-up included), the
median in-step time (worker side vs loop), and the Dask scheduling share
``1 - task_seconds[0] / phase seconds``.

Each side waits for a quiet machine first and is rerun when other programs used more
than ``--max-foreign`` cores meanwhile (measured from /proc/stat minus this process
tree); the per-process/per-thread CPU use in steady training is printed for both sides.
Results are appended to ``benchmarks/results/<name>.json`` (``--out``, ``--overwrite``).
The ``--worker-*`` and baseline malloc switches are for diagnosis; their defaults are
what a user gets.

    python benchmarks/bench_overhead.py              # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
from typing import Any

from baseline import hand_loop
from cli_args import add_quiet_args, add_worker_args, add_workload_args
from engine_run import run_fit
from measure import median, print_gc, scheduling_share, steady_boundary, steady_fit, steady_loop
from processes import SINGLE_THREAD_ENV, in_subprocess
from quiet import measure_side, print_threads
from records import save_run, table
from workloads import CNNConfig, OptimConfig, Workload, parameter_count

NAME = "bench_overhead"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(p, samples=2048, epochs=25, channels="16,32", convs=1, hidden=64)
    p.add_argument(
        "--order",
        choices=("hand-first", "dataflow-first"),
        default="hand-first",
        help="which side runs first (they never run concurrently)",
    )
    p.add_argument(
        "--hand-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for the hand-loop process (diagnosis), repeatable",
    )
    add_worker_args(p)
    p.add_argument(
        "--hand-malloc",
        choices=("default", "mallopt"),
        default="default",
        help="mallopt: the hand loop calls the same glibc mallopt() as --worker-malloc-trim "
        "mallopt (diagnosis: the engine's own overhead with equal allocators)",
    )
    add_quiet_args(p)
    p.add_argument("--out", help="JSON file (default benchmarks/results/bench_overhead.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file instead of appending")
    return p.parse_args(argv)


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
    hand_env = dict(SINGLE_THREAD_ENV)
    hand_env.update(kv.split("=", 1) for kv in args.hand_env)
    print(
        f"{NAME}: CNN {model.channels} ({parameter_count(model)} params), "
        f"{work.samples} samples {model.in_channels}x{model.image}x{model.image}, "
        f"global batch {work.batch}, {work.epochs} epochs = {work.steps} steps, 1 thread"
    )

    runners = {
        "hand": lambda: in_subprocess(
            hand_loop, work, 1, args.hand_malloc == "mallopt", env=hand_env
        ),
        "dataflow": lambda: run_fit(
            work,
            replicas=1,
            window_seconds=args.window_seconds,
            malloc_trim=args.worker_malloc_trim,
            worker_profile=args.worker_profile == "on",
            engine_relax_malloc=args.engine_relax_malloc == "on",
            gc_freeze=args.worker_gc_freeze,
        ),
    }
    sides: dict[str, Any] = {}
    quiet: dict[str, Any] = {}
    for side in ("hand", "dataflow") if args.order == "hand-first" else ("dataflow", "hand"):
        sides[side], quiet[side] = measure_side(
            side,
            runners[side],
            retries=args.retries,
            max_wait=args.max_wait,
            max_foreign=args.max_foreign,
        )
    hand, fit = sides["hand"], sides["dataflow"]
    history = fit["history"]
    steps, phase = history["steps"], history["phases"][0]
    if len(steps) != len(hand["ends"]):
        raise RuntimeError(f"dataflow ran {len(steps)} steps, the hand loop {len(hand['ends'])}")

    first = steady_boundary(steps, args.warmup)
    samples_per_step = [s["samples"] for s in steps]
    steady_df = steady_fit(steps, first)
    steady_hand = steady_loop(hand["ends"], samples_per_step, first)
    df_step = median([s["seconds"] for s in steps[first:]])
    hand_step = median(hand["step_seconds"][first:])
    hand_load = median(hand["load_seconds"][first:])
    total_samples = sum(samples_per_step)
    df_whole = history["info"]["train_seconds"] / total_samples
    hand_whole = hand["total_seconds"] / total_samples
    steady_gap = 1.0 - sum(s["seconds"] for s in steps[first:]) / steady_df.seconds
    share = scheduling_share(phase, 0)
    loss_diff = max(
        abs(a - b) for a, b in zip((s["loss"] for s in steps), hand["losses"], strict=True)
    )

    ratio = steady_df.seconds_per_sample / steady_hand.seconds_per_sample
    rows = [
        [
            "hand loop",
            f"{steady_hand.seconds_per_sample * 1e6:.1f}",
            f"{hand_whole * 1e6:.1f}",
            f"{hand_step * 1e3:.2f}",
            f"{steady_hand.samples_per_second:.0f}",
        ],
        [
            "dataflow fit",
            f"{steady_df.seconds_per_sample * 1e6:.1f}",
            f"{df_whole * 1e6:.1f}",
            f"{df_step * 1e3:.2f}",
            f"{steady_df.samples_per_second:.0f}",
        ],
    ]
    print(
        table(rows, ["side", "steady us/sample", "whole us/sample", "median step ms", "samples/s"])
    )
    print(
        f"steady state: steps {first}..{len(steps) - 1} ({steady_df.steps} steps, "
        f"{steady_df.samples} samples); dataflow windows: {phase['windows']} "
        f"(~{len(steps) // max(phase['windows'], 1)} steps each)"
    )
    print(f"ratio fit/hand-loop (steady, time per sample): {ratio:.4f}  (target <= 1.02)")
    print(f"ratio fit/hand-loop (whole run, warm-up included): {df_whole / hand_whole:.4f}")
    print(f"ratio median in-step time (worker / loop): {df_step / hand_step:.4f}")
    print(
        f"Dask scheduling share (1 - task_seconds/phase seconds): {share * 100:.3f} %  "
        f"(target < 1 %); steady-state gap share: {steady_gap * 100:.3f} %"
    )
    gaps = fit["gaps"][0]
    fixed = {k: v for k, v in gaps["sum_gaps_seconds"].items() if k != "train->train"}
    print(
        f"worker idle between windows (Dask round trip): median "
        f"{gaps['median_train_window_gap_seconds'] * 1e3:.2f} ms over "
        f"{gaps['count_gaps'].get('train->train', 0)} gaps; fixed per-phase gaps "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in fixed.items())
    )
    window_compute = sum(
        v for k, v in gaps["sum_compute_seconds"].items() if k in ("train", "calibrate")
    )
    outside = {
        "driver<->worker edges (phase seconds - worker span)": phase["seconds"]
        - gaps["span_seconds"],
        "worker idle between tasks": sum(gaps["sum_gaps_seconds"].values()),
        "begin/end-phase tasks": sum(
            v for k, v in gaps["sum_compute_seconds"].items() if k not in ("train", "calibrate")
        ),
        "Dask task overhead around run_window": window_compute - phase["task_seconds"][0],
    }
    print(
        f"phase wall not in window tasks: {(phase['seconds'] - phase['task_seconds'][0]) * 1e3:.1f}"
        " ms = " + " + ".join(f"{k} {v * 1e3:.1f} ms" for k, v in outside.items())
    )
    print(
        "cores used by other programs meanwhile (should be ~0): "
        + ", ".join(f"{k} {q['attempts'][-1]['foreign_cores']:.3f}" for k, q in quiet.items())
        + f"; dataflow workers: {', '.join(fit['worker_env'])} "
        f"(--worker-malloc-trim {args.worker_malloc_trim}, "
        f"--engine-relax-malloc {args.engine_relax_malloc}, "
        f"--worker-gc-freeze {args.worker_gc_freeze}, "
        f"--worker-profile {args.worker_profile}, --hand-malloc {args.hand_malloc})"
    )
    print_gc(fit)
    print_threads(quiet)
    if any(q["disturbed"] for q in quiet.values()):
        print("WARNING: a side was disturbed by other programs; its figures are not comparable")
    print(
        f"hand loop median load (index_select) per step: {hand_load * 1e3:.3f} ms; "
        f"max |loss difference| over all steps: {loss_diff:.3g}"
    )

    stages = phase["stage_seconds"][0]
    run = {
        "args": vars(args),
        "workload": work,
        "hand_env": hand_env,
        "steady": {
            "first_step": first,
            "steps": steady_df.steps,
            "samples": steady_df.samples,
            "dataflow_seconds": steady_df.seconds,
            "hand_seconds": steady_hand.seconds,
            "dataflow_seconds_per_sample": steady_df.seconds_per_sample,
            "hand_seconds_per_sample": steady_hand.seconds_per_sample,
        },
        "ratio_fit_over_hand_steady": ratio,
        "ratio_fit_over_hand_whole": df_whole / hand_whole,
        "ratio_median_step": df_step / hand_step,
        "target_ratio": 1.02,
        "scheduling_share": share,
        "steady_gap_share": steady_gap,
        "target_scheduling_share": 0.01,
        "dataflow": {
            "train_seconds": history["info"]["train_seconds"],
            "fit_seconds": history["info"]["fit_seconds"],
            "fit_call_seconds": fit["fit_call_seconds"],
            "median_step_seconds": df_step,
            "phase": phase,
            "stage_share_of_task": {k: v / phase["task_seconds"][0] for k, v in stages.items()},
            "workers": history["info"]["workers"],
            "step_seconds": [s["seconds"] for s in steps],
            "step_times": [s["time"] for s in steps],
        },
        "hand": {
            "total_seconds": hand["total_seconds"],
            "median_step_seconds": hand_step,
            "median_load_seconds": hand_load,
            "torch_threads": hand["torch_threads"],
            "step_seconds": hand["step_seconds"],
        },
        "worker_gaps": gaps,
        "outside_window_tasks_seconds": outside,
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
