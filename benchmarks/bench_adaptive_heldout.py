"""Adaptive against a fixed small batch on four kinds of data, with SGD and with Adam.

Issue 15, item 7: "Adaptive keeps small-batch accuracy on data it was not tuned on".
Four datasets of different kinds, all made on the spot (``dataflow.tools.datasets``), each
with a fixed held-out split:

* **digits** (2D images, classification): sklearn's bundled handwritten digits, 8x8,
  10 classes, 80/20 split; a small 2D CNN; score: held-out accuracy (%).
* **cosmo** (3D volumes, regression): log-normal 16^3 density fields, targets the power
  spectrum's amplitude and index (``cosmology_arrays``); a small 3D CNN; score: R^2 (%).
* **signals** (1D signals, classification): noisy waveforms of six kinds
  (``signals_arrays``: sine, square, sawtooth, burst, rising and falling chirp); a small
  1D CNN; score: held-out accuracy (%).
* **gratings** (2D images, regression): noisy oriented gratings (``gratings_arrays``),
  targets ``cos 2θ, sin 2θ`` and the spatial frequency; a small 2D CNN; score: R^2 (%).

R^2 is ``100 (1 - MSE / MSE_mean)`` averaged over the targets, ``MSE_mean`` the
predict-the-training-mean baseline on the same held-out set.

For each dataset and each optimizer (SGD with momentum 0.9, Adam), the same epochs,
several seeds (model init and data order; data and split fixed), on one 2-worker
LocalCluster (1 thread per worker, 2 replicas, reused by every fit):

* ``fixed``: ``Fixed(B0)`` at the base LR ``lr0`` of that dataset and optimizer (from a
  one-off sweep of ``Fixed(B0)``, ``--tune``; the chosen values are ``LR0`` below);
* ``adaptive``: ``Adaptive(B0, max_batch=BMAX)`` with every other argument at its
  default, on the same ``lr0`` (the base LR at ``B0``).

Targets: the adaptive mean within 0.5 points of the fixed mean on every dataset x
optimizer, with >= 2x fewer optimizer steps.

Fits are deterministic for a seed, so ``--fixed-from`` can reuse an earlier run's
Fixed(B0) fits (same epochs and lr0) while Adaptive is changed. The ``--adaptive-*``
switches change one of Adaptive's arguments, for diagnosis only (the targets are about
its defaults).

    python benchmarks/bench_adaptive_heldout.py            # 3 seeds, ~10 min on 2 idle cores
    python benchmarks/bench_adaptive_heldout.py --seeds 5  # the reported table
    python benchmarks/bench_adaptive_heldout.py --quick    # smoke test: 1 seed, ~1 min
    python benchmarks/bench_adaptive_heldout.py --tune     # the LR sweep of Fixed(B0), 1 seed
    python benchmarks/bench_adaptive_heldout.py --seeds 5 --lr-decay cosine --versus none
                                               # both under a cosine decay, against no decay
    python benchmarks/bench_adaptive_heldout.py --tune --lr-decay cosine   # its own sweep
    python benchmarks/bench_adaptive_heldout.py --seeds 5 --lr-decay cosine --lr0 tuned \
        --versus none                          # at the LR that sweep chose
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from records import RESULTS, save_run, table
from workloads import CosmoNet, DigitsNet, Optimizer, SignalNet, TargetMSE, ship_to_workers

from dataflow.tools.datasets import cosmology_arrays, digits_arrays, gratings_arrays, signals_arrays

NAME = "adaptive_heldout"
B0, BMAX = 16, 512
DATASETS = ("digits", "cosmo", "signals", "gratings")
OPTIMIZERS = ("sgd", "adam")
KINDS = {
    "digits": "2D images, classification",
    "cosmo": "3D volumes, regression",
    "signals": "1D signals, classification",
    "gratings": "2D images, regression",
}
# The base LR at B0 per dataset and optimizer: the best final score of Fixed(B0) in one
# sweep (python benchmarks/bench_adaptive_heldout.py --tune, 1 seed, the full epochs;
# saved in results/adaptive_heldout.json as the run with "mode": "tune").
LR0 = {
    ("digits", "sgd"): 0.03,
    ("digits", "adam"): 0.003,
    ("cosmo", "sgd"): 0.003,
    ("cosmo", "adam"): 0.003,
    ("signals", "sgd"): 0.03,
    ("signals", "adam"): 0.003,
    ("gratings", "sgd"): 0.03,
    ("gratings", "adam"): 0.001,
}
TUNE_LRS = {"sgd": (0.003, 0.01, 0.03, 0.1), "adam": (0.0003, 0.001, 0.003)}
# Under a decay the mean LR is lower: the sweep reaches higher (--tune --lr-decay cosine)
TUNE_LRS_DECAYED = {"sgd": (0.01, 0.03, 0.1, 0.3), "adam": (0.001, 0.003, 0.01)}


# -- models and metrics (module level: pickled to the workers by value) ---------------------


class GratingNet(torch.nn.Module):
    """Two 2D conv stages on 16x16, a two-layer head (3 targets)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 4 * 4, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# -- datasets ---------------------------------------------------------------------------


@dataclass
class Dataset:
    name: str
    train: Any
    test: Any
    model: Any
    loss: Any
    metrics: dict[str, Any]
    baseline_mse: list[float] | None = None  # regressions: predict-the-mean MSE per target
    info: dict[str, Any] = field(default_factory=dict)


def prepare(name: str, quick: bool) -> Dataset:
    from dataflow.io import ArraySource
    from dataflow.stages import accuracy

    if name == "digits":
        arrays: dict[str, Any] = digits_arrays()
        model, loss = DigitsNet, F.cross_entropy
    elif name == "cosmo":
        arrays = cosmology_arrays(*((512, 256) if quick else (1024, 512)))
        model, loss = CosmoNet, F.mse_loss
    elif name == "signals":
        arrays = signals_arrays(*((1200, 600) if quick else (2400, 1200)))
        model, loss = SignalNet, F.cross_entropy
    elif name == "gratings":
        arrays = gratings_arrays(*((1024, 512) if quick else (2048, 1024)))
        model, loss = GratingNet, F.mse_loss
    else:
        raise SystemExit(f"unknown dataset {name!r}; use {', '.join(DATASETS)}")
    train = ArraySource(arrays["x_train"], arrays["y_train"])
    test = ArraySource(arrays["x_test"], arrays["y_test"], shuffle=False)
    y_test = arrays["y_test"]
    if y_test.ndim == 1:  # classification
        metrics: dict[str, Any] = {"loss": F.cross_entropy, "accuracy": accuracy}
        baseline = None
    else:  # standardised targets: the training mean is 0
        metrics = {f"mse_{j}": TargetMSE(j) for j in range(y_test.shape[1])}
        baseline = [float((y_test[:, j] ** 2).mean()) for j in range(y_test.shape[1])]
    info = {
        "kind": KINDS[name],
        "train": len(arrays["y_train"]),
        "test": len(y_test),
        "x_shape": list(arrays["x_train"].shape[1:]),
        "baseline_mse": baseline,
    }
    return Dataset(name, train, test, model, loss, metrics, baseline, info)


def score(dataset: Dataset, last: dict[str, Any]) -> float:
    """Held-out accuracy (%) or mean R^2 (%) from the last epoch's eval metrics."""
    if dataset.baseline_mse is None:
        return 100 * last["eval_accuracy"]
    r2 = [1 - last[f"eval_mse_{j}"] / b for j, b in enumerate(dataset.baseline_mse)]
    return 100 * statistics.fmean(r2)


# -- one fit ----------------------------------------------------------------------------


DECAYS = ("none", "cosine")


def lr_decay(name: str) -> Any:
    """``--lr-decay``: None, or a cosine decay to 0 over the fit (no warmup: B0 is small)."""
    from dataflow.schedule import CosineDecay

    return None if name == "none" else CosineDecay()


def fit_one(
    dataset: Dataset,
    schedule: Any,
    optimizer: Optimizer,
    epochs: int,
    seed: int,
    client: Any,
    decay: Any = None,
) -> dict[str, Any]:
    import dataflow as dfl
    from dataflow import stages

    graph = dfl.Graph()
    node = graph.add(stages.Load(dataset.train))
    node = graph.add(stages.Forward(dataset.model, dataset.loss), node)
    node = graph.add(stages.Backward(), node)
    node = graph.add(stages.AllReduce(), node)
    node = graph.add(stages.Update(optimizer), node)
    # scored once, at the end; a fit counting progress ends at an epoch of data not
    # known ahead, so it is scored every epoch and the last one read
    every = 1 if getattr(schedule, "counts_progress", False) else epochs
    graph.add(stages.Evaluate(dataset.test, metrics=dataset.metrics, every_epochs=every), node)
    trainer = dfl.Trainer(
        graph, schedule=schedule, lr_decay=decay, seed=seed, progress=False, replicas=2
    )
    started = time.perf_counter()
    history = trainer.fit(epochs, client).history
    last = history.epochs[-1]
    return {
        "score": score(dataset, last),
        "steps": len(history.steps),
        "samples": sum(s["samples"] for s in history.steps),
        "train_seconds": history.info["train_seconds"],
        "fit_seconds": time.perf_counter() - started,
        "final_train_loss": last["train_loss"],
        "phases": [
            {
                k: p[k]
                for k in (
                    "phase",
                    "start_epoch",
                    "end_epoch",
                    "global_batch",
                    "lr",
                    "steps",
                    "noise_scale",
                    "gain",
                    "measured_noise_scale",
                    "progress_end",
                )
                if k in p
            }
            for p in history.phases
        ],
    }


def adaptive_schedule(args: argparse.Namespace, kind: str) -> Any:
    """``Adaptive(B0, max_batch=BMAX)`` at its defaults, or with the diagnosis overrides."""
    from dataflow.schedule import Adaptive

    extra: dict[str, Any] = {}
    if args.adaptive_lr_rule:
        extra["lr_rule"] = args.adaptive_lr_rule
    if args.adaptive_optimizer:
        extra["optimizer"] = kind
    if args.adaptive_warmup is not None:
        extra["warmup_steps"] = args.adaptive_warmup
    if args.adaptive_target is not None:
        extra["target"] = args.adaptive_target
    if args.adaptive_confirm:
        extra["confirm_growth"] = True
    if args.adaptive_shrink is not None:
        extra["may_shrink"] = args.adaptive_shrink == "on"
    if args.adaptive_min_efficiency is not None:
        extra["min_efficiency"] = args.adaptive_min_efficiency or None
    if args.adaptive_scale_invariant:
        extra["scale_invariant"] = True
    return Adaptive(B0, max_batch=BMAX, **extra)


# -- reporting -----------------------------------------------------------------------------


def mean_range(summary: dict[str, Any], label: str) -> str:
    mean, low, high = (summary[f"{label}_{k}"] for k in ("mean", "min", "max"))
    return f"{mean:.2f}" if low == high else f"{mean:.2f} ({low:.2f}..{high:.2f})"


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    fixed, adaptive = runs["fixed"], runs["adaptive"]
    f_scores, a_scores = [r["score"] for r in fixed], [r["score"] for r in adaptive]
    f_steps = statistics.fmean(r["steps"] for r in fixed)
    a_steps = statistics.fmean(r["steps"] for r in adaptive)
    diff = statistics.fmean(a_scores) - statistics.fmean(f_scores)
    return {
        "fixed_mean": statistics.fmean(f_scores),
        "fixed_min": min(f_scores),
        "fixed_max": max(f_scores),
        "adaptive_mean": statistics.fmean(a_scores),
        "adaptive_min": min(a_scores),
        "adaptive_max": max(a_scores),
        "difference_points": diff,
        "fixed_steps": f_steps,
        "adaptive_steps": a_steps,
        "step_ratio": f_steps / a_steps,
        "final_batches": [r["phases"][-1]["global_batch"] for r in adaptive],
        "within_0.5_points": diff >= -0.5,
        "steps_2x": f_steps / a_steps >= 2.0,
    }


def print_table(summaries: dict[tuple[str, str], dict[str, Any]]) -> None:
    rows = []
    for (name, kind), s in summaries.items():
        unit = "R^2 %" if name in ("cosmo", "gratings") else "acc %"
        rows.append(
            [
                f"{name} ({unit})",
                kind,
                mean_range(s, "fixed"),
                mean_range(s, "adaptive"),
                f"{s['difference_points']:+.2f}",
                f"{s['fixed_steps']:.0f}",
                f"{s['adaptive_steps']:.0f}",
                f"{s['step_ratio']:.2f}x",
                "/".join(str(b) for b in sorted(set(s["final_batches"]))),
                "MET" if s["within_0.5_points"] and s["steps_2x"] else "MISSED",
            ]
        )
    header = [
        "dataset",
        "optimizer",
        "fixed B0 mean (min..max)",
        "adaptive mean (min..max)",
        "diff",
        "fixed steps",
        "adaptive steps",
        "ratio",
        "final B",
        "target",
    ]
    print(table(rows, header), flush=True)


def print_phases(run: dict[str, Any]) -> None:
    parts = []
    for p in run["phases"]:
        noise = p["measured_noise_scale"]
        parts.append(
            f"e{p['start_epoch']}:B={p['global_batch']},lr={p['lr']:.3g}"
            + (f",Bn={noise:.0f}" if noise is not None else "")
        )
    print("      " + " ".join(parts), flush=True)


def earlier_runs(
    path: str | None, key: str, epochs: int, lr: float | None, decay: str, label: str = "fixed"
) -> dict[int, Any]:
    """``{seed: run}`` of schedule ``label`` for ``key`` from the last run in ``path`` with
    these epochs, lr0 (None: any) and LR decay."""
    if not path:
        return {}
    import json

    found: dict[int, Any] = {}
    for record in json.loads(Path(path).read_text())["runs"]:
        entry = record.get("results", {}).get(key)
        same = record.get("epochs") == epochs and (record.get("lr_decay") or "none") == decay
        if same and entry and "runs" in entry and (lr is None or entry.get("lr0") == lr):
            found = {run["seed"]: run for run in entry["runs"][label]}
    return found


def base_lr(args: argparse.Namespace, key: str, name: str, kind: str, epochs: int) -> float:
    """``LR0``, or with ``--lr0 tuned`` the best LR of the last ``--tune`` run in the
    results file with these epochs and this LR decay."""
    if args.lr0 == "table":
        return LR0[(name, kind)]
    import json

    best = None
    for record in json.loads((RESULTS / f"{NAME}.json").read_text())["runs"]:
        same = record.get("epochs") == epochs and (record.get("lr_decay") or "none") == (
            args.lr_decay
        )
        entry = record.get("results", {}).get(key)
        if record.get("mode") == "tune" and same and entry:
            best = float(entry["best"])
    if best is None:
        raise SystemExit(
            f"--lr0 tuned: no --tune run for {key} at {epochs} epochs with --lr-decay "
            f"{args.lr_decay} in {RESULTS / f'{NAME}.json'}; run --tune first"
        )
    return best


def print_versus(record: dict[str, Any], path: str, decay: str) -> None:
    """Each schedule's mean score against the same schedule of ``path``'s matching run
    under LR decay ``decay`` (``--versus``), on the seeds both ran."""
    rows = []
    for key, entry in record["results"].items():
        for label, runs in entry["runs"].items():
            theirs = earlier_runs(path, key, record["epochs"], None, decay, label)
            pairs = [(r["score"], theirs[r["seed"]]["score"]) for r in runs if r["seed"] in theirs]
            if pairs:
                mine, other = (statistics.fmean(p[i] for p in pairs) for i in (0, 1))
                rows.append([key, label, f"{other:.2f}", f"{mine:.2f}", f"{mine - other:+.2f}"])
    if rows:
        header = ["dataset/optimizer", "schedule", f"lr_decay={decay}", "this run", "diff"]
        print(table(rows, header), flush=True)


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 4 epochs, less data")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated subset")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="sgd, adam or both")
    p.add_argument("--seeds", type=int, default=None, help="seeds per schedule (3; quick: 1)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per fit (15; quick: 4)")
    p.add_argument("--tune", action="store_true", help="instead: sweep lr0 for Fixed(B0)")
    # Diagnosis switches (defaults: Adaptive's own defaults, what the targets are about).
    p.add_argument("--adaptive-lr-rule", default=None, help="override Adaptive's lr_rule")
    p.add_argument(
        "--adaptive-optimizer",
        action="store_true",
        help="pass optimizer='sgd'/'adam' to Adaptive (what the engine would tell it)",
    )
    p.add_argument("--adaptive-warmup", type=int, default=None, help="override warmup_steps")
    p.add_argument("--adaptive-target", type=float, default=None, help="override target")
    p.add_argument("--adaptive-confirm", action="store_true", help="confirm_growth=True")
    p.add_argument("--adaptive-shrink", choices=("on", "off"), help="override may_shrink")
    p.add_argument("--adaptive-min-efficiency", type=float, default=None, help="override (0: None)")
    p.add_argument(
        "--adaptive-scale-invariant",
        action="store_true",
        help="scale_invariant=True: the epochs count progress at B0 (more epochs of data)",
    )
    p.add_argument(
        "--fixed-from",
        help="a JSON file of an earlier run: reuse its Fixed(B0) runs (deterministic for a "
        "seed) instead of training them again, when they match epochs and lr0",
    )
    p.add_argument(
        "--lr-decay",
        choices=DECAYS,
        default="none",
        help="a decay of the LR over the fit for every schedule (cosine: to 0, no warmup)",
    )
    p.add_argument(
        "--lr0",
        choices=("table", "tuned"),
        default="table",
        help="the base LR: the script's LR0 table (tuned without a decay), or the best of "
        "the last --tune run with the same --lr-decay",
    )
    p.add_argument(
        "--versus",
        metavar="DECAY",
        choices=DECAYS,
        help="also print each schedule's mean against its runs under this LR decay in "
        "--fixed-from's file (or the default results file), seed for seed",
    )
    p.add_argument("--out", help=f"JSON file (default benchmarks/results/{NAME}.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file, not append")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from dataflow.runtime.cluster import client_or_local_cluster
    from dataflow.schedule import Fixed

    if __name__ != "__main__":  # imported (a smoke test): ship this module by value too
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ship_to_workers()
    seeds = args.seeds or (1 if args.quick else 3)
    epochs = args.epochs or (4 if args.quick else 15)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    kinds = [k.strip() for k in args.optimizers.split(",") if k.strip()]
    load = os.getloadavg()
    mode = "tune" if args.tune else ("quick" if args.quick else "full")
    print(
        f"{NAME}: {mode}, {epochs} epochs, {1 if args.tune else seeds} seed(s), B0={B0}, "
        f"Bmax={BMAX}, 2 replicas; load average {load[0]:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    started = time.perf_counter()
    record: dict[str, Any] = {
        "mode": mode,
        "args": vars(args),
        "epochs": epochs,
        "seeds": seeds,
        "B0": B0,
        "Bmax": BMAX,
        "lr_decay": args.lr_decay,
        "load_average_start": load,
        "results": {},
    }
    summaries: dict[tuple[str, str], dict[str, Any]] = {}
    with client_or_local_cluster(None, n_workers=2, announce=False) as client:
        for name in names:
            dataset = prepare(name, args.quick)
            print(f"{name}: {dataset.info}", flush=True)
            for kind in kinds:
                key = f"{name}/{kind}"
                decay = lr_decay(args.lr_decay)
                if args.tune:
                    sweep = {}
                    grid = TUNE_LRS if decay is None else TUNE_LRS_DECAYED
                    for lr in grid[kind]:
                        optimizer = Optimizer(kind, lr)
                        run = fit_one(dataset, Fixed(B0), optimizer, epochs, 0, client, decay)
                        sweep[str(lr)] = run
                        print(f"  {key} lr0={lr}: score {run['score']:.2f}", flush=True)
                    best = max(sweep, key=lambda lr: sweep[lr]["score"])
                    print(f"  {key}: best lr0 {best}", flush=True)
                    record["results"][key] = {"info": dataset.info, "sweep": sweep, "best": best}
                    continue
                optimizer = Optimizer(kind, base_lr(args, key, name, kind, epochs))
                plans = {"fixed": Fixed(B0), "adaptive": adaptive_schedule(args, kind)}
                runs: dict[str, list[dict[str, Any]]] = {label: [] for label in plans}
                reused = earlier_runs(args.fixed_from, key, epochs, optimizer.lr, args.lr_decay)
                for seed in range(seeds):
                    for label, schedule in plans.items():
                        if label == "fixed" and seed in reused:
                            runs[label].append(reused[seed])
                            continue
                        run = fit_one(dataset, schedule, optimizer, epochs, seed, client, decay)
                        run["seed"] = seed
                        runs[label].append(run)
                        print(
                            f"  {key} seed {seed} {label:<8}: score {run['score']:6.2f}, "
                            f"{run['steps']:4d} steps, {run['fit_seconds']:5.1f} s",
                            flush=True,
                        )
                        if label == "adaptive":
                            print_phases(run)
                summary = summarize(runs)
                summaries[(name, kind)] = summary
                record["results"][key] = {
                    "info": dataset.info,
                    "lr0": optimizer.lr,
                    "schedules": {label: repr(s) for label, s in plans.items()},
                    "runs": runs,
                    "summary": summary,
                }
    record["seconds"] = time.perf_counter() - started
    record["load_average_end"] = os.getloadavg()
    if summaries:
        print_table(summaries)
        met = all(s["within_0.5_points"] and s["steps_2x"] for s in summaries.values())
        record["all_targets_met"] = met
        print(f"every dataset x optimizer within 0.5 points at >= 2x fewer steps: {met}")
    if args.versus:
        print_versus(record, args.fixed_from or str(RESULTS / f"{NAME}.json"), args.versus)
    print(f"total {record['seconds']:.0f} s", flush=True)
    path = save_run(NAME, record, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return record


if __name__ == "__main__":
    main()
