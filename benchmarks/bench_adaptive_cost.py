"""What measuring the gradient noise scale costs: ``Adaptive(B, max_batch=B)`` (the batch
never grows, so only the measurement differs) against ``Fixed(B)`` on the same fit.

Issue 26, item 7 ("an auto-tuner that costs nothing"). A small 1D CNN (three conv
stages, 6k parameters) on ``signals_arrays`` (1D waveforms, 6 classes), SGD with
momentum, 2 replicas on one 2-worker LocalCluster (1 thread per worker, started once and
reused by every fit), the same seed and data order in every fit. Sides:

* ``fixed``: ``Fixed(B)``, one phase;
* ``fixed-phased``: ``Fixed(B, epochs_per_phase=1)``: Adaptive's phase boundaries (one
  per epoch, which Adaptive needs to change the batch) without its measurement, so
  ``fixed-phased / adaptive`` is what the measurement itself costs;
* ``adaptive``: ``Adaptive(B, max_batch=B)`` with its defaults;
* ``adaptive-kK`` (with ``--measure-every K``): the same with ``measure_every=K``.

The sides run interleaved (each side once per round, the order rotated every round) for
``--runs`` rounds, after one warm-up fit, so a machine shared with other programs slows
neighbouring fits alike. Per fit: ``wall``, the fit's training wall time
(``history.info["train_seconds"]``: phases, windows, boundaries) per optimizer step;
``in-step``, the median of the replicas' time inside a step (worker side); ``outside
tasks``, the wall time in which the replicas ran no window task (phase boundaries, the
driver's round trips), per step. The table
gives each side's median and best wall time over the rounds, and the ratios
``fixed / side`` and ``fixed-phased / side`` (1.0 = free): the median over the rounds of
the ratio of the two fits of a round (neighbours in time), and best over best.

First, in this process (no cluster), the measurement path alone: ``--path-rounds``
rounds of 24 steps of the same model on a one-rank gloo group through the engine's
BucketReducer, alternately measured and not (the local norm per bucket, the pair, and
the window's read of the pairs), timed in this thread's CPU time, which a loaded machine
disturbs far less than wall time: what a measured step adds. It runs on engines before
issue 26 item 7 too (a host read per measured step), for the before/after figures.
Results are appended to ``benchmarks/results/adaptive_cost.json``.

    python benchmarks/bench_adaptive_cost.py             # 6 rounds, ~3 min on 2 cores
    python benchmarks/bench_adaptive_cost.py --runs 2 --epochs 4   # smoke test
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from records import save_run, table
from workloads import SignalNet, ship_to_workers

NAME = "adaptive_cost"
SIDES = ("fixed", "fixed-phased", "adaptive")


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def has_measure_every() -> bool:
    """Engines before issue 26 item 7 measured every step and had no option."""
    import dataflow as dfl

    return "measure_every" in inspect.signature(dfl.schedule.Adaptive).parameters


def schedule_of(side: str, batch: int) -> Any:
    import dataflow as dfl

    if side == "fixed":
        return dfl.schedule.Fixed(batch)
    if side == "fixed-phased":
        return dfl.schedule.Fixed(batch, epochs_per_phase=1)
    if side == "adaptive":
        return dfl.schedule.Adaptive(batch, max_batch=batch)
    if side.startswith("adaptive-k"):
        every = int(side.removeprefix("adaptive-k"))
        return dfl.schedule.Adaptive(batch, max_batch=batch, measure_every=every)
    raise ValueError(f"unknown side {side!r}")


def measurement_path(rounds: int, window: int = 24) -> dict[str, Any]:
    """CPU microseconds per step of the reducer's path, measured and not (see above)."""
    from dataflow.runtime import window_parts
    from dataflow.runtime.collective import Collective, open_store
    from dataflow.stages.reducer import BucketReducer

    per_step = "measure" in inspect.signature(BucketReducer.begin_step).parameters
    collective = Collective(
        open_store("127.0.0.1", 1, 30.0),
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        host="127.0.0.1",
        timeout_s=30.0,
        prefix="path",
    )
    torch.manual_seed(0)
    model = SignalNet()
    x, y = torch.randn(50, 1, 128), torch.randint(0, 6, (50,))
    reducer = BucketReducer(list(model.parameters()), collective, cap_bytes=25 << 20)
    optimizer = sgd(model.parameters())

    def one_window(measure: bool) -> float:
        pairs: list[tuple] = []
        started = time.thread_time()
        for index in range(window):
            if per_step:
                reducer.begin_step(0.5, measure=measure)
            else:  # before: the phase's flag, and a host read in every measured finish()
                reducer.measure = measure
                reducer.begin_step(0.5)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            reducer.finish()
            if measure:
                reduced = reducer.grad_sq if per_step else reducer.reduced_sq
                pairs.append((index, 25, reducer.local_sq / 0.25, 50, reduced))
            optimizer.step()
        if hasattr(window_parts, "host_pairs"):
            window_parts.host_pairs(pairs)  # the window's one read of its pairs
        return 1e6 * (time.thread_time() - started) / window

    one_window(True), one_window(False)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for measure in (True, False) if r % 2 else (False, True):
            times[measure].append(one_window(measure))
    reducer.close()
    added = [m - u for m, u in zip(times[True], times[False], strict=True)]
    return {
        "host_read": "once per window" if per_step else "every measured step",
        "unmeasured_us": statistics.median(times[False]),
        "measured_us": statistics.median(times[True]),
        "added_us": statistics.median(added),
    }


def fit_one(side: str, args: argparse.Namespace, arrays: dict[str, Any], client: Any) -> dict:
    import dataflow as dfl

    pipe = dfl.Pipeline(
        model=SignalNet,
        loss=F.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ArraySource(arrays["x_train"], arrays["y_train"]),
        schedule=schedule_of(side, args.batch),
        seed=args.seed,
        progress=False,
        replicas=2,
        threads_per_replica=1,
    )
    started = time.perf_counter()
    history = pipe.fit(epochs=args.epochs, client=client).history
    fit_seconds = time.perf_counter() - started
    steps, train = history.steps, history.info["train_seconds"]
    # the replicas' time inside window tasks; the rest is scheduling: phase boundaries
    # (end of phase, the next one's begin) and the driver's round trips between windows
    per_replica = zip(*(p["task_seconds"] for p in history.phases), strict=True)
    in_tasks = statistics.fmean(sum(seconds) for seconds in per_replica)
    return {
        "side": side,
        "steps": len(steps),
        "phases": len(history.phases),
        "train_seconds": train,
        "fit_seconds": fit_seconds,
        "wall_ms_per_step": 1e3 * train / len(steps),
        "in_step_ms": 1e3 * statistics.median(s["seconds"] for s in steps),
        "outside_tasks_ms_per_step": 1e3 * (train - in_tasks) / len(steps),
        "measured_noise_scale": history.phases[-1].get("measured_noise_scale"),
    }


def summarize(fits: list[dict[str, Any]], sides: list[str]) -> dict[str, Any]:
    """Per side: median and best wall time per step, median in-step time, and the ratios
    to fixed and fixed-phased (median of each round's pair, and best over best)."""
    wall = {side: [f["wall_ms_per_step"] for f in fits if f["side"] == side] for side in sides}
    summary: dict[str, Any] = {}
    for side in sides:
        summary[side] = {
            "wall_ms_per_step": statistics.median(wall[side]),
            "wall_ms_best": min(wall[side]),
            "in_step_ms": statistics.median(f["in_step_ms"] for f in fits if f["side"] == side),
            "outside_tasks_ms_per_step": statistics.median(
                f["outside_tasks_ms_per_step"] for f in fits if f["side"] == side
            ),
        }
        for base, key in (("fixed", "fixed_over_side"), ("fixed-phased", "phased_over_side")):
            pairs = zip(wall[base], wall[side], strict=True)
            summary[side][key] = statistics.median(b / s for b, s in pairs)
            summary[side][key + "_best"] = min(wall[base]) / min(wall[side])
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=100, help="global batch B (default 100)")
    p.add_argument("--samples", type=int, default=2400, help="training samples (default 2400)")
    p.add_argument("--epochs", type=int, default=8, help="epochs per fit (default 8)")
    p.add_argument("--runs", type=int, default=6, help="rounds over the sides (default 6)")
    p.add_argument(
        "--path-rounds",
        type=int,
        default=40,
        help="rounds of the in-process measurement path (default 40; 0 skips it)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--measure-every",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="add the side adaptive-kK, Adaptive(..., measure_every=K) (repeatable)",
    )
    p.add_argument("--label", default="", help="a note saved with the run (e.g. 'before')")
    p.add_argument("--out", help="JSON file (default benchmarks/results/adaptive_cost.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file instead of appending")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from distributed import Client

    from dataflow.runtime.cluster import start_local_cluster
    from dataflow.tools.datasets import signals_arrays

    args = parse_args(argv)
    if args.measure_every and not has_measure_every():
        raise SystemExit("this dataflow has no Adaptive(measure_every=...): it measures every step")
    sides = [*SIDES, *(f"adaptive-k{k}" for k in args.measure_every)]
    arrays = signals_arrays(args.samples, 64)
    ship_to_workers()
    steps = args.epochs * -(-args.samples // args.batch)
    print(
        f"{NAME}: 1D CNN ({sum(p.numel() for p in SignalNet().parameters())} params), "
        f"{args.samples} samples, B={args.batch}, {args.epochs} epochs = {steps} steps, "
        f"2 replicas, {args.runs} runs of {', '.join(sides)}"
    )
    torch.set_num_threads(1)
    cost = measurement_path(args.path_rounds) if args.path_rounds else None
    if cost is not None:
        print(
            f"measurement path (CPU time of this thread, host read {cost['host_read']}): "
            f"{cost['unmeasured_us']:.0f} us/step unmeasured, {cost['measured_us']:.0f} "
            f"measured: +{cost['added_us']:.1f} us per measured step"
        )
    fits: list[dict[str, Any]] = []
    with (
        start_local_cluster(2) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        fit_one("fixed", args, arrays, client)  # warm-up: imports, first-fit costs
        for run in range(args.runs):
            for side in sides[run % len(sides) :] + sides[: run % len(sides)]:  # rotated
                fit = fit_one(side, args, arrays, client)
                fit["run"] = run
                fits.append(fit)
                print(
                    f"  run {run} {side:>14}: {fit['wall_ms_per_step']:.2f} ms/step wall, "
                    f"{fit['in_step_ms']:.2f} ms in-step, "
                    f"{fit['outside_tasks_ms_per_step']:.2f} ms outside tasks",
                    flush=True,
                )
    summary = summarize(fits, sides)
    rows = [
        [
            side,
            f"{s['wall_ms_per_step']:.2f} ({s['wall_ms_best']:.2f})",
            f"{s['fixed_over_side']:.2f}x ({s['fixed_over_side_best']:.2f}x)",
            f"{s['phased_over_side']:.2f}x ({s['phased_over_side_best']:.2f}x)",
            f"{s['in_step_ms']:.2f}",
            f"{s['outside_tasks_ms_per_step']:.2f}",
        ]
        for side, s in summary.items()
    ]
    header = ["side", "wall ms/step (best)", "fixed/side (best)", "phased/side (best)"]
    print("\n" + table(rows, [*header, "in-step ms", "outside tasks ms/step"]))
    run = {
        "label": args.label,
        "measure_every_option": has_measure_every(),
        "args": vars(args),
        "measurement_path": cost,
        "summary": summary,
        "fits": fits,
    }
    path = save_run(NAME, run, args.out, overwrite=args.overwrite)
    print(f"\nsaved to {path}")
    return run


if __name__ == "__main__":
    main()
