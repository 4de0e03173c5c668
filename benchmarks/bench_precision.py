"""Held-out quality of bf16 and fp16 training against fp32, on two kinds of data.

Issue 26's target: "accuracy, bf16 and fp16 vs fp32 (digits and the 3-D cosmo set,
3 seeds): within 0.3 points". The same ``dfl.Pipeline`` is fitted with
``precision="fp32"``, ``"bf16"`` and ``"fp16"`` (fp16 with the loss scale the engine
owns), and ``"bf16-allreduce"`` (fp32 compute, ``allreduce_dtype="bf16"``: the
gradient buckets travel as bf16), with the same batches, epochs, optimizer and LR for
all (the fp32 settings; nothing is tuned per precision), over several seeds (model init and data
order; data and split fixed), on one embedded 2-worker LocalCluster (1 thread per
worker, 2 replicas) reused by every fit:

* **digits** (2D images, classification): sklearn's bundled handwritten digits, 8x8,
  10 classes, 80/20 split (``dataflow.tools.datasets.digits_arrays``); the 2D CNN of
  examples/digits.py; SGD (momentum 0.9); score: held-out accuracy (%).
* **cosmo** (3D volumes, regression): log-normal 16^3 density fields, targets the
  power spectrum's amplitude ``A`` and index ``n``, standardised
  (``dataflow.tools.datasets.cosmology_arrays``); the 3D CNN of examples/cosmoflow.py; Adam;
  score: held-out R^2 (%), ``100 (1 - MSE / MSE_mean)`` averaged over ``A`` and ``n``
  (``MSE_mean``: predict-the-training-mean on the same held-out set); the held-out
  MSE of each target is recorded too.

Per dataset and precision: the mean, standard deviation and range of the score over
the seeds, and the bf16 and fp16 means minus the fp32 mean (points of accuracy or of
R^2) against the 0.3-point target, and the spread of the per-seed differences (each
seed's fits share the init and the data order, so only the arithmetic differs). The
fp16 fits' skipped (overflow) steps and final loss scale are recorded from
``history.phases``.

On the CPU autocast runs but is slow (fp16 convolutions most of all: about 30x fp32
for the 3D net); this benchmark is about the numbers, not the speed.

    python benchmarks/bench_precision.py            # 3 seeds, ~12 min on 2 loaded cores
    python benchmarks/bench_precision.py --quick    # smoke test: 1 seed, 2 epochs
    python benchmarks/bench_precision.py --report   # the saved runs' tables again
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from records import save_run, table
from workloads import CosmoNet, DigitsNet, Optimizer, TargetMSE, ship_to_workers

from dataflow.tools.datasets import cosmology_arrays, digits_arrays

# fp16 on the CPU is refused to users (many times slower than fp32); this benchmark
# measures its numbers, not its speed, on the CPU on purpose
os.environ.setdefault("DATAFLOW_ALLOW_CPU_FP16", "1")

NAME = "precision"
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-allreduce")
# each side: (Pipeline precision, Pipeline allreduce_dtype); "bf16-allreduce" computes
# in fp32 and sends the gradient buckets as bf16 (half the bytes on the wire)
SIDES = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "fp32"),
    "fp16": ("fp16", "fp32"),
    "bf16-allreduce": ("fp32", "bf16"),
}
DATASETS = ("digits", "cosmo")
TARGET_POINTS = 0.3
# The fp32 settings of each dataset, used unchanged for bf16 and fp16. Digits: the
# tests' digits fit (tests/conftest.py's digits_accuracy: batch 64, SGD lr 0.05, momentum
# 0.9, 10 epochs); cosmo: Adam at the LR bench_adaptive_heldout tuned for it, batch 32,
# a smaller set and fewer epochs than there, so that the slow CPU fp16 fits stay short.
SETTINGS: dict[str, dict[str, Any]] = {
    "digits": {
        "kind": "2D images, classification",
        "optimizer": "sgd",
        "lr": 0.05,
        "batch": 64,
        "epochs": 10,
        "unit": "acc %",
    },
    "cosmo": {
        "kind": "3D volumes, regression",
        "optimizer": "adam",
        "lr": 0.003,
        "batch": 32,
        "epochs": 8,
        "train": 512,
        "test": 256,
        "unit": "R^2 %",
    },
}


@dataclass
class Dataset:
    name: str
    train: Any
    test: Any
    model: Any
    loss: Any
    metrics: dict[str, Any]
    baseline_mse: list[float] | None
    info: dict[str, Any]


def prepare(name: str, quick: bool) -> Dataset:
    from dataflow.io import ArraySource
    from dataflow.stages import accuracy

    settings = SETTINGS[name]
    if name == "digits":
        arrays: dict[str, Any] = digits_arrays()
        model, loss = DigitsNet, F.cross_entropy
    else:
        n_train, n_test = (256, 128) if quick else (settings["train"], settings["test"])
        arrays = cosmology_arrays(n_train, n_test)
        model, loss = CosmoNet, F.mse_loss
    y_test = arrays["y_test"]
    if y_test.ndim == 1:
        metrics: dict[str, Any] = {"loss": F.cross_entropy, "accuracy": accuracy}
        baseline = None
    else:  # standardised targets: the training mean is 0
        metrics = {f"mse_{j}": TargetMSE(j) for j in range(y_test.shape[1])}
        baseline = [float((y_test[:, j] ** 2).mean()) for j in range(y_test.shape[1])]
    info = {
        "kind": settings["kind"],
        "train": len(arrays["y_train"]),
        "test": len(y_test),
        "x_shape": list(arrays["x_train"].shape[1:]),
        "baseline_mse": baseline,
    }
    return Dataset(
        name,
        ArraySource(arrays["x_train"], arrays["y_train"]),
        ArraySource(arrays["x_test"], y_test, shuffle=False),
        model,
        loss,
        metrics,
        baseline,
        info,
    )


def score(dataset: Dataset, last: dict[str, Any]) -> float:
    """Held-out accuracy (%) or mean R^2 (%) from the last epoch's eval metrics."""
    if dataset.baseline_mse is None:
        return 100 * float(last["eval_accuracy"])
    r2 = [1 - float(last[f"eval_mse_{j}"]) / b for j, b in enumerate(dataset.baseline_mse)]
    return 100 * statistics.fmean(r2)


def fit_one(
    dataset: Dataset, precision: str, epochs: int, seed: int, client: Any
) -> dict[str, Any]:
    """One fit; ``precision``: a side of SIDES."""
    import dataflow as dfl

    settings = SETTINGS[dataset.name]
    pipe = dfl.Pipeline(
        model=dataset.model,
        loss=dataset.loss,
        optimizer=Optimizer(settings["optimizer"], settings["lr"]),
        source=dataset.train,
        eval_source=dataset.test,
        metrics=dataset.metrics,
        schedule=dfl.schedule.Fixed(settings["batch"]),
        seed=seed,
        replicas=2,
        device="cpu",
        precision=SIDES[precision][0],
        allreduce_dtype=SIDES[precision][1],
        progress=False,
    )
    started = time.perf_counter()
    history = pipe.fit(epochs=epochs, client=client).history
    last = history.epochs[-1]
    run: dict[str, Any] = {
        "seed": seed,
        "precision": precision,
        "score": score(dataset, last),
        "eval": {k: float(v) for k, v in last.items() if k.startswith("eval_")},
        "final_train_loss": last.get("train_loss"),
        "steps": len(history.steps),
        "train_seconds": history.info.get("train_seconds"),
        "fit_seconds": time.perf_counter() - started,
        "workers_precision": sorted(
            {str(w.get("precision")) for w in history.info.get("workers") or []}
        ),
    }
    if precision == "fp16":
        run["overflow_steps"] = sum(int(p.get("overflow_steps") or 0) for p in history.phases)
        run["loss_scale"] = history.phases[-1].get("loss_scale")
    return run


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for precision, items in runs.items():
        scores = [r["score"] for r in items]
        out[precision] = {
            "mean": statistics.fmean(scores),
            "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
            "min": min(scores),
            "max": max(scores),
            "scores": scores,
        }
        if precision == "fp16":
            out[precision]["overflow_steps"] = [r["overflow_steps"] for r in items]
            out[precision]["loss_scale"] = [r["loss_scale"] for r in items]
    if "fp32" not in out:
        return out
    base = out["fp32"]["mean"]
    for precision in out:
        if precision == "fp32":
            continue
        diff = out[precision]["mean"] - base
        # per seed, the same init and data order: only the arithmetic differs
        pairs = zip(runs[precision], runs["fp32"], strict=True)
        paired = [a["score"] - b["score"] for a, b in pairs]
        out[precision]["diff_vs_fp32"] = diff
        out[precision]["paired_diffs"] = paired
        out[precision]["paired_diff_std"] = statistics.stdev(paired) if len(paired) > 1 else 0.0
        out[precision]["within_target"] = abs(diff) <= TARGET_POINTS
    return out


def print_table(summaries: dict[str, dict[str, Any]]) -> None:
    rows = []
    for name, by_precision in summaries.items():
        for precision, s in by_precision.items():
            diff = s.get("diff_vs_fp32")
            fp16 = ""
            if precision == "fp16":
                scales = "/".join(f"2^{int(x).bit_length() - 1}" for x in s["loss_scale"])
                fp16 = f"{'/'.join(str(n) for n in s['overflow_steps'])}; {scales}"
            rows.append(
                [
                    f"{name} ({SETTINGS[name]['unit']})",
                    precision,
                    f"{s['mean']:.2f}",
                    f"{s['std']:.2f}",
                    f"{s['min']:.2f}..{s['max']:.2f}",
                    "" if diff is None else f"{diff:+.2f}",
                    "" if diff is None else f"{s['paired_diff_std']:.2f}",
                    "" if diff is None else ("MET" if s["within_target"] else "MISSED"),
                    fp16,
                ]
            )
    header = [
        "dataset",
        "precision",
        "mean",
        "std",
        "min..max",
        "diff vs fp32",
        "std of per-seed diffs",
        f"|diff| <= {TARGET_POINTS}",
        "fp16 overflow steps; final scale",
    ]
    print(table(rows, header), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 2 epochs, less data")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated subset")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated subset")
    p.add_argument("--seeds", type=int, default=None, help="seeds per precision (3; quick: 1)")
    p.add_argument("--epochs", type=int, default=None, help="override every dataset's epochs")
    p.add_argument("--out", help=f"JSON file (default benchmarks/results/{NAME}.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file, not append")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument(
        "--report",
        action="store_true",
        help="fit nothing: print the tables of the runs saved in the JSON file",
    )
    return p.parse_args(argv)


def report(path: str | None) -> list[dict[str, Any]]:
    """The table of every run saved in ``path`` (default results/precision.json),
    summarised again from its fits."""
    import json
    from pathlib import Path

    from records import RESULTS

    runs = json.loads(Path(path or RESULTS / f"{NAME}.json").read_text())["runs"]
    out = []
    for record in runs:
        epochs = {name: r["epochs"] for name, r in record["results"].items()}
        print(
            f"{record['machine']['date']}: {record['mode']}, {record['seeds']} seed(s), "
            f"epochs {epochs}, {record['seconds']:.0f} s",
            flush=True,
        )
        summaries = {name: summarize(r["runs"]) for name, r in record["results"].items()}
        print_table(summaries)
        out.append(summaries)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.report:
        return report(args.out)
    from distributed import Client, LocalCluster

    if __name__ != "__main__":  # imported (a smoke test): ship this module by value too
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ship_to_workers()
    seeds = args.seeds or (1 if args.quick else 3)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in SIDES]
    if unknown or "fp32" not in precisions:
        raise SystemExit(f"--precisions: from {', '.join(SIDES)}, fp32 included; got {unknown}")
    load = os.getloadavg()
    print(
        f"{NAME}: {'quick' if args.quick else 'full'}, {seeds} seed(s), precisions "
        f"{', '.join(precisions)}, 2 replicas; load average {load[0]:.2f} on "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    started = time.perf_counter()
    record: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "args": vars(args),
        "seeds": seeds,
        "target_points": TARGET_POINTS,
        "settings": SETTINGS,
        "load_average_start": load,
        "results": {},
    }
    summaries: dict[str, dict[str, Any]] = {}
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        for name in names:
            dataset = prepare(name, args.quick)
            epochs = args.epochs or (2 if args.quick else SETTINGS[name]["epochs"])
            print(f"{name}: {dataset.info}, {epochs} epochs", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}
            for seed in range(seeds):
                for precision in precisions:
                    run = fit_one(dataset, precision, epochs, seed, client)
                    runs[precision].append(run)
                    extra = ""
                    if precision == "fp16":
                        extra = (
                            f", {run['overflow_steps']} overflow steps, scale {run['loss_scale']}"
                        )
                    print(
                        f"  {name} seed {seed} {precision}: score {run['score']:.2f}, "
                        f"{run['steps']} steps, {run['fit_seconds']:.1f} s{extra}",
                        flush=True,
                    )
            summaries[name] = summarize(runs)
            record["results"][name] = {
                "info": dataset.info,
                "epochs": epochs,
                "runs": runs,
                "summary": summaries[name],
            }
    record["seconds"] = time.perf_counter() - started
    record["load_average_end"] = os.getloadavg()
    print_table(summaries)
    print(f"{NAME}: {record['seconds']:.0f} s in all", flush=True)
    if not args.no_save:
        path = save_run(NAME, record, args.out, overwrite=args.overwrite)
        print(f"saved {path}", flush=True)
    return record


if __name__ == "__main__":
    main()
