"""Does the calibrated cost model predict the step time of real fits on this machine?

For each model (the demo's 2D FieldNet on random fields; a CosmoFlow-style 3D CNN on
``dataflow.tools.datasets`` log-normal volumes), on one 2-worker LocalCluster (1 thread each):

1. calibrate once (``dataflow.costmodel.calibrate``, the pipe at its middle batch);
2. run real fits with ``cost_model=`` at three global batches B: 1 replica at B, and
   2 replicas at B (*equal global batch*: each replica computes B/2) and at 2B (*equal
   local batch*: each computes B, as the 1-replica fit), Fixed(B), the default window;
3. compare each phase's prediction (``history.phases[0]["predicted"]["step_s"]``) with
   its measured steady step time (``["measured_step_seconds"]``: window commits on the
   driver's clock after the phase's first windows, per step), the bar being 15 %.

Other programs on the machine distort both sides: before each calibration and fit the
script waits (up to ``--max-wait`` s) until other programs use < 0.15 cores, measures
the CPU others used meanwhile, reruns a disturbed fit (``--retries``) and flags rows
still disturbed (the ``others`` column, in cores; ``*`` above ``--max-foreign``).

    python benchmarks/bench_costmodel.py                  # both models, about 5 min
    python benchmarks/bench_costmodel.py --models fieldnet --compare global
    python benchmarks/bench_costmodel.py --seconds 8      # longer fits, steadier
    python benchmarks/bench_costmodel.py --link-mbit 1000 # 2 emulated nodes on 1 Gbit/s

With ``--link-mbit R`` the two workers are emulated nodes (``EmulatedNodes``: network
namespaces on veth links capped at R Mbit/s each way; root only), so the calibration
measures the link between them and the 2-replica fits pay for it. After each
calibration, allreduces of sizes it did not measure (2, 8 and 32 MB and the model's
gradient) are timed and set against the calibrated link's prediction (bar 20 %).

Prints the table and appends the run to benchmarks/results/costmodel.json.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quiet import wait_quiet
from records import save_run, table
from workloads import CosmoNet, ship_to_workers

import dataflow as dfl
from dataflow.costmodel import allreduce_seconds, calibrate, measure_allreduce
from dataflow.runtime.cluster import client_or_local_cluster
from dataflow.tools.cpu_meter import CpuMeter

BAR = 0.15
ALLREDUCE_BAR = 0.20
HELD_OUT_BYTES = (2 << 20, 8 << 20, 32 << 20)  # not among calibrate()'s sizes


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def workload(name: str, samples: int) -> dict[str, Any]:
    """The model, loss, optimizer and data of one benchmark model."""
    if name == "fieldnet":
        from dataflow.tools.demo import FieldNet, random_fields

        x, y = random_fields(samples)
        return {"model": FieldNet, "loss": F.cross_entropy, "optimizer": sgd, "x": x, "y": y}
    if name == "cosmoflow":
        from dataflow.tools.datasets import cosmology_arrays

        data = cosmology_arrays(samples, 1, side=16)
        x, y = data["x_train"], data["y_train"]
        return {"model": CosmoNet, "loss": F.mse_loss, "optimizer": adam, "x": x, "y": y}
    raise SystemExit(f"--models: unknown model {name!r} (fieldnet, cosmoflow)")


def pipeline(work: dict[str, Any], batch: int, replicas: int, **options: Any) -> dfl.Pipeline:
    return dfl.Pipeline(
        model=work["model"],
        loss=work["loss"],
        optimizer=work["optimizer"],
        source=dfl.io.ArraySource(work["x"], work["y"]),
        schedule=dfl.schedule.Fixed(batch),
        replicas=replicas,
        progress=False,
        **options,
    )


def measured(label: str, fn: Any, args: argparse.Namespace) -> tuple[Any, float]:
    """``fn()`` on a quiet machine, rerun while others used > ``--max-foreign`` cores."""
    for attempt in range(args.retries + 1):
        wait_quiet(args.max_wait)
        with CpuMeter() as meter:
            value = fn()
        others = meter.foreign_cpu_seconds / meter.wall_seconds
        if others <= args.max_foreign:
            break
        more = "; again" if attempt < args.retries else ""
        print(f"    {label}: disturbed, other programs used {others:.2f} cores{more}", flush=True)
    return value, others


def calibration_batches(batches: list[int], args: argparse.Namespace) -> list[int]:
    """The local batches calibration times. ``--calibrate-at held-out`` (default): none
    of the local batches the fits run (B/2 ... B): 3/4 of the smallest, the geometric
    middle and 3/2 of the largest, so every validated point is a prediction between or
    beyond measured ones, not a re-measurement. ``same``: the fits' own batches."""
    local = sorted({max(1, b // 2) for b in batches} | set(batches))
    if args.calibrate_at == "same":
        return local
    low, high = local[0], local[-1]
    picks = {max(1, round(0.75 * low)), round(math.sqrt(low * high)), round(1.5 * high)}
    picks -= set(local)
    return sorted(picks)


def run_model(name: str, client: Any, args: argparse.Namespace) -> dict[str, Any]:
    batches = args.batches[name]
    work = workload(name, args.samples[name])
    mid = batches[len(batches) // 2]
    print(f"{name}: calibrating on {len(work['x'])} samples ...", flush=True)
    started = time.perf_counter()
    model, others = measured(
        f"{name} calibration",
        lambda: calibrate(
            pipeline(work, mid, 2),
            client,
            batch_sizes=calibration_batches(batches, args),
        ),
        args,
    )
    calibration = {
        "seconds": time.perf_counter() - started,
        "others_cores": others,
        "model": model.to_dict(),
    }
    print(
        f"  calibrated in {calibration['seconds']:.0f} s (others {others:.2f} cores): compute "
        + ", ".join(f"{b}: {t * 1e3:.1f} ms" for b, t in model.compute.points)
        + f"; shared {model.compute.shared}, sync {model.sync_overhead_s * 1e3:.2f} ms; "
        f"α {model.topology.intra.latency_s * 1e6:.0f} us, "
        f"β {model.topology.intra.bandwidth / 1e9:.2f} GB/s; window overhead "
        f"{model.window_overhead_s * 1e3:.2f} ms",
        flush=True,
    )
    calibration["allreduce"] = held_out_allreduce(client, model)
    cases = []
    for batch in batches:
        cases.append(("one", 1, batch))
        if args.compare in ("global", "both"):
            cases.append(("global", 2, batch))
        if args.compare in ("local", "both"):
            cases.append(("local", 2, 2 * batch))
    rows = []
    for compare, replicas, batch in cases:
        predicted = model.breakdown(replicas=replicas, global_batch=batch)
        steps = math.ceil(args.seconds / predicted.step_s) + 3 * predicted.steps_per_window
        per_epoch = len(work["x"]) // batch
        epochs = max(1, math.ceil(steps / per_epoch))
        pipe = pipeline(work, batch, replicas, cost_model=model, drop_last=True)
        result, others = measured(
            f"{name} {replicas}x B={batch}", lambda p=pipe, e=epochs: p.fit(e, client), args
        )
        phase = result.history.phases[0]
        pred, step = phase["predicted"], phase["measured_step_seconds"]
        rows.append(
            {
                "model": name,
                "compare": compare,
                "replicas": replicas,
                "global_batch": batch,
                "local_batch": pred["local_batch"],
                "predicted_s": pred["step_s"],
                "measured_s": step,
                "error": pred["step_s"] / step - 1,
                "predicted": pred,
                "steps": phase["steps"],
                "windows": phase["windows"],
                "others_cores": others,
            }
        )
        print(f"  {_line(rows[-1], args)}", flush=True)
    return {"calibration": calibration, "rows": rows}


def held_out_allreduce(client: Any, model: Any) -> list[dict[str, Any]]:
    """Allreduces of sizes the calibration did not time, measured and predicted from
    the calibrated link (the ring's closed form over the two workers)."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])[:2]
    sizes = sorted({*HELD_OUT_BYTES, model.gradient_bytes})
    times, backend = measure_allreduce(client, workers, sizes, repeats=7)
    rows = []
    for size in sizes:
        predicted = allreduce_seconds(size, len(workers), model.topology)
        rows.append(
            {
                "bytes": size,
                "predicted_s": predicted,
                "measured_s": times[size],
                "error": predicted / times[size] - 1,
                "backend": backend,
            }
        )
        print(
            f"  allreduce {size / 2**20:6.2f} MB: predicted {predicted * 1e3:7.2f} ms, "
            f"measured {times[size] * 1e3:7.2f} ms ({rows[-1]['error'] * 100:+.1f} %)",
            flush=True,
        )
    return rows


def _line(row: dict[str, Any], args: argparse.Namespace) -> str:
    return "  ".join(str(c) for c in _cells(row, args))


def _cells(row: dict[str, Any], args: argparse.Namespace) -> list[Any]:
    p = row["predicted"]
    flag = "*" if row["others_cores"] > args.max_foreign else ""
    return [
        row["model"],
        row["replicas"],
        row["global_batch"],
        row["local_batch"],
        row["compare"],
        f"{row['predicted_s'] * 1e3:.2f}",
        f"{row['measured_s'] * 1e3:.2f}",
        f"{row['error'] * 100:+.1f}",
        f"{p['compute_s'] * 1e3:.2f}",
        f"{p['allreduce_exposed_s'] * 1e3:.2f}",
        f"{p.get('sync_s', 0.0) * 1e3:.2f}",
        f"{p['overhead_s'] * 1e3:.3f}",
        f"{p['data_wait_s'] * 1e3:.2f}",
        f"{row['steps']}/{row['windows']}",
        f"{row['others_cores']:.2f}{flag}",
    ]


HEADER = [
    "model", "R", "B", "b", "compare", "pred ms", "meas ms", "err %", "compute",
    "allreduce", "sync", "overhead", "data wait", "steps/win", "others",
]  # fmt: skip


def parse_batches(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes like 32,64,128") from exc
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be >= 1")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog="\n\n".join(doc.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default="fieldnet,cosmoflow", help="fieldnet,cosmoflow (both)")
    p.add_argument(
        "--fieldnet-batches", type=parse_batches, default=[32, 64, 128], help="32,64,128"
    )
    p.add_argument("--cosmoflow-batches", type=parse_batches, default=[8, 16, 32], help="8,16,32")
    p.add_argument(
        "--calibrate-at",
        choices=("held-out", "same"),
        default="held-out",
        help="calibrate at local batches the fits do not run (held-out, default: 3/4 of "
        "the smallest, the geometric middle, 3/2 of the largest) or at the fits' own (same)",
    )
    p.add_argument(
        "--compare",
        choices=("global", "local", "both"),
        default="both",
        help="2 replicas at the same global batch as 1 (global), at twice it, the same "
        "local batch (local), or both (default)",
    )
    p.add_argument(
        "--seconds", type=float, default=4.0, help="steady training per fit, predicted (4)"
    )
    p.add_argument("--retries", type=int, default=1, help="reruns of a disturbed fit (1)")
    p.add_argument(
        "--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine (60)"
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="cores used by other programs during a fit above which it is rerun (0.1)",
    )
    p.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="run the 2 workers as emulated nodes on links of this many Mbit/s (root)",
    )
    p.add_argument("--note", default="", help="a remark saved with the run (how it was run)")
    p.add_argument("--out", help="JSON file (default benchmarks/results/costmodel.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the JSON's earlier runs")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.batches = {"fieldnet": args.fieldnet_batches, "cosmoflow": args.cosmoflow_batches}
    largest = {m: 2 * max(args.batches[m]) for m in args.batches}
    args.samples = {"fieldnet": max(2048, 16 * largest["fieldnet"]), "cosmoflow": 512}
    args.samples["cosmoflow"] = max(args.samples["cosmoflow"], 8 * largest["cosmoflow"])
    return args


@contextlib.contextmanager
def cluster(args: argparse.Namespace) -> Iterator[Any]:
    """A client of 2 single-threaded workers: a LocalCluster, or with ``--link-mbit``
    two emulated nodes on links of that rate."""
    if args.link_mbit is None:
        with client_or_local_cluster(None, n_workers=2, announce=False) as client:
            yield client
        return
    from distributed import Client

    from dataflow.tools.emulated_nodes import EmulatedNodes

    with EmulatedNodes(2, rate_mbit=args.link_mbit) as nodes, Client(nodes.address) as client:
        print(f"2 emulated nodes on {args.link_mbit:g} Mbit/s links", flush=True)
        yield client


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    ship_to_workers()  # the workers unpickle workloads' models without importing that module
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with cluster(args) as client:
        for name in args.models:
            results[name] = run_model(name, client, args)
    rows = [row for r in results.values() for row in r["rows"]]
    held_out = [row for r in results.values() for row in r["calibration"]["allreduce"]]
    print()
    print(table([_cells(row, args) for row in rows], HEADER))
    worst = max((abs(row["error"]) for row in rows), default=0.0)
    disturbed = sum(row["others_cores"] > args.max_foreign for row in rows)
    worst_allreduce = max((abs(row["error"]) for row in held_out), default=0.0)
    print(
        f"\nworst error {worst * 100:.1f} % (bar {BAR * 100:.0f} %); held-out allreduces' "
        f"worst {worst_allreduce * 100:.1f} % (bar {ALLREDUCE_BAR * 100:.0f} %); {disturbed} "
        f"of {len(rows)} rows disturbed by other programs (*); "
        f"{time.perf_counter() - started:.0f} s"
    )
    run = {
        "note": args.note,
        "args": {k: v for k, v in vars(args).items()},
        "results": results,
        "worst_error": worst,
        "worst_allreduce_error": worst_allreduce,
        "disturbed_rows": disturbed,
        "seconds": time.perf_counter() - started,
    }
    path = save_run("costmodel", run, args.out, overwrite=args.overwrite)
    print(f"saved to {path}")
    return run


if __name__ == "__main__":
    main()
