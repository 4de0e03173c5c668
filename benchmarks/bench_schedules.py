"""Accuracy at equal epochs: fixed small batch, fixed large batch, Stepwise and Adaptive.

Issue 5's first experiment. Two datasets, each written to zarr first
(``dataflow.io.to_zarr``) and read back with ``ZarrSource``, with a fixed held-out split:

* **digits**: sklearn's bundled handwritten digits (1797 real 8x8 images, 10 classes),
  80/20 split; a small 2D CNN, cross entropy; the score is the held-out accuracy (%).
* **cosmo**: a synthetic 3D cosmology-style regression. Each sample is a 16^3 Gaussian
  random field with power spectrum ``P(k) = A (k / k_pivot)^n``, log-normal transformed
  (``delta = exp(g - var/2) - 1``, a density contrast >= -1); the targets are (A, n),
  standardised with the training set's mean and std. A small 3D CNN (``log1p`` inside
  the model), MSE loss. The score is R^2 in % (``100 (1 - MSE / MSE_mean)``, mean of
  the two parameters), where ``MSE_mean`` is the predict-the-training-mean baseline on
  the same held-out set; per-parameter RMSE relative to that baseline is printed too.

For each dataset, on a 2-worker LocalCluster (1 thread per worker, 2 replicas), the same
epochs, SGD with momentum 0.9 and one base LR ``lr0`` at the small batch ``B0``:

* ``fixed-small``: ``Fixed(B0)`` at ``lr0`` (``lr0`` tuned once for this schedule, see
  ``--tune``);
* ``fixed-large``: ``Fixed(Bmax)`` at ``lr0 * Bmax / B0`` (linear scaling);
* ``stepwise``: ``Stepwise`` doubling the batch from ``B0`` to ``Bmax`` at fixed
  fractions of the run (10, 20, 30 and 50 % of the epochs for 16 -> 256), LR by linear
  scaling, ``warmup_steps`` ramp at each boundary;
* ``adaptive``: ``Adaptive(B0, max_batch=Bmax)`` with its defaults (1 epoch per phase,
  ``max_growth=2``, ``target=1``), LR by AdaScale's gain (``lr_rule="adascale"``), the
  same ``warmup_steps``;
* ``stepwise-sqrt`` (a diagnosis, no target): the Stepwise table with ``lr_scaling="sqrt"``,
  to tell a batch that is too large from an LR rule that overshoots.

Per run: the final held-out score, optimizer steps, samples, ``train_seconds`` (the
engine's wall time of the training phases, without cluster start-up) and each phase's
batch, LR and noise-scale estimate. With several seeds (model init and data order; the
data and the split stay fixed) the mean and the spread (min..max) are printed. Targets
(issue 5): Stepwise and Adaptive within 0.5 points of fixed-small, with >= 4x fewer
optimizer steps and >= 1.5x less wall time in at least one of the two datasets.

    python benchmarks/bench_schedules.py             # full: 3 seeds, ~10 min on 2 cores
    python benchmarks/bench_schedules.py --quick     # smoke test, ~1 min
    python benchmarks/bench_schedules.py --tune      # the one-off LR sweep of fixed-small, ~5 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from records import save_run, table
from workloads import CosmoNet, DigitsNet, ship_to_workers

from dataflow.tools.datasets import (
    AMPLITUDE_RANGE,
    INDEX_RANGE,
    K_PIVOT,
    cosmology_arrays,
    digits_arrays,
)

NAME = "schedules"
B0, BMAX = 16, 256
# The base LRs at B0, from one sweep of fixed-small (python benchmarks/bench_schedules.py
# --tune; the sweep is saved in results/schedules.json as the run with "mode": "tune").
DEFAULT_LR = {"digits": 0.01, "cosmo": 0.003}


# -- the datasets --------------------------------------------------------------------------


# The generators are the library's (the examples use them too): dataflow.tools.datasets.


def write_zarr(arrays: dict[str, Any], root: Path) -> tuple[Any, Any]:
    """Train and test sets to two zarr stores (small chunks, so the epoch shuffle, which
    permutes chunks and samples inside a few chunks, mixes well); ZarrSources on them."""
    from dataflow.io import ZarrSource, to_zarr

    sources = []
    for part in ("train", "test"):
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        chunk_mb = 32 * x[0].nbytes / 1e6  # 32 samples per chunk
        path = to_zarr(root / f"{part}.zarr", x, y, chunk_mb=chunk_mb)
        sources.append(ZarrSource(path, x="x", y="y", shuffle=part == "train"))
    return sources[0], sources[1]


# -- the models and metrics (module level: pickled to the workers) --------------------------


def mse_a(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((output[:, 0] - y[:, 0]) ** 2).mean()


def mse_n(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((output[:, 1] - y[:, 1]) ** 2).mean()


@dataclass(frozen=True)
class SGD:
    """Picklable ``params -> SGD(lr, momentum)``."""

    lr: float
    momentum: float = 0.9

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)


# -- the schedules ---------------------------------------------------------------------


def stepwise_table(epochs: int) -> dict[int, int]:
    """Double from B0 to BMAX at 10, 20, 30 and 50 % of the epochs (later epochs win a tie)."""
    table_: dict[int, int] = {0: B0}
    batch = B0
    for fraction in (0.1, 0.2, 0.3, 0.5):
        batch *= 2
        epoch = max(1, round(fraction * epochs))
        if epoch < epochs:
            table_[epoch] = batch
    # with few epochs, several doublings land on one epoch: keep the largest batch there
    return dict(sorted(table_.items()))


def schedules(epochs: int, lr0: float, warmup_steps: int) -> dict[str, Any]:
    from dataflow.schedule import Adaptive, Fixed, Stepwise

    return {
        "fixed-small": (Fixed(B0), lr0),
        "fixed-large": (Fixed(BMAX), lr0 * BMAX / B0),
        "stepwise": (
            Stepwise(stepwise_table(epochs), lr_scaling="linear", warmup_steps=warmup_steps),
            lr0,
        ),
        "adaptive": (
            Adaptive(B0, max_batch=BMAX, lr_rule="adascale", warmup_steps=warmup_steps),
            lr0,
        ),
        # a diagnosis, not a target row: the same table with the gentler sqrt LR rule
        "stepwise-sqrt": (
            Stepwise(stepwise_table(epochs), lr_scaling="sqrt", warmup_steps=warmup_steps),
            lr0,
        ),
    }


# -- one fit -----------------------------------------------------------------------------


@dataclass
class Dataset:
    name: str
    train: Any
    test: Any
    model: Any
    loss: Any
    metrics: dict[str, Any]
    baseline_mse: list[float] | None = None  # cosmo: predict-the-mean MSE per parameter
    info: dict[str, Any] = field(default_factory=dict)


def score(dataset: Dataset, last: dict[str, Any]) -> dict[str, float]:
    """The held-out score (%) and its parts from the last epoch's eval metrics."""
    if dataset.name == "digits":
        return {"score": 100 * last["eval_accuracy"], "eval_loss": last["eval_loss"]}
    mse = [last["eval_mse_a"], last["eval_mse_n"]]
    base = dataset.baseline_mse
    assert base is not None
    r2 = [1 - m / b for m, b in zip(mse, base, strict=True)]
    return {
        "score": 100 * statistics.fmean(r2),
        "r2_A": r2[0],
        "r2_n": r2[1],
        "rel_rmse_A": (mse[0] / base[0]) ** 0.5,
        "rel_rmse_n": (mse[1] / base[1]) ** 0.5,
    }


def fit_one(
    dataset: Dataset, schedule: Any, lr: float, epochs: int, seed: int, client: Any
) -> dict[str, Any]:
    import dataflow as dfl
    from dataflow import stages

    graph = dfl.Graph()
    node = graph.add(stages.Load(dataset.train))
    node = graph.add(stages.Forward(dataset.model, dataset.loss), node)
    node = graph.add(stages.Backward(), node)
    node = graph.add(stages.AllReduce(), node)
    node = graph.add(stages.Update(SGD(lr)), node)
    # only at the end: per-epoch evaluation would add the same cost to every schedule
    graph.add(stages.Evaluate(dataset.test, metrics=dataset.metrics, every_epochs=epochs), node)
    trainer = dfl.Trainer(graph, schedule=schedule, seed=seed, progress=False, replicas=2)
    started = time.perf_counter()
    result = trainer.fit(epochs, client)
    history = result.history
    last = history.epochs[-1]
    return {
        **score(dataset, last),
        "steps": len(history.steps),
        "samples": sum(s["samples"] for s in history.steps),
        "train_seconds": history.info["train_seconds"],
        "fit_seconds": time.perf_counter() - started,
        "final_train_loss": last["train_loss"],
        "train_loss_per_epoch": [e["train_loss"] for e in history.epochs],
        "phases": [
            {
                k: p[k]
                for k in (
                    "phase",
                    "start_epoch",
                    "end_epoch",
                    "global_batch",
                    "lr",
                    "local_batches",
                    "steps",
                    "seconds",
                    "noise_scale",
                    "gain",
                    "measured_noise_scale",
                )
            }
            for p in history.phases
        ],
    }


# -- the comparison ------------------------------------------------------------------------


def prepare(name: str, root: Path, quick: bool) -> Dataset:
    from dataflow.stages import accuracy

    started = time.perf_counter()
    if name == "digits":
        arrays = digits_arrays()
        train, test = write_zarr(arrays, root / name)
        dataset = Dataset(
            name,
            train,
            test,
            DigitsNet,
            F.cross_entropy,
            {"loss": F.cross_entropy, "accuracy": accuracy},
        )
        info = {"classes": 10, "image": [8, 8]}
    else:
        n_train, n_test = (512, 256) if quick else (2048, 512)
        arrays = cosmology_arrays(n_train, n_test)
        train, test = write_zarr(arrays, root / name)
        # predict-the-training-mean: the standardised targets' mean is 0 on the train set
        baseline = [float((arrays["y_test"][:, j] ** 2).mean()) for j in range(2)]
        dataset = Dataset(
            name, train, test, CosmoNet, F.mse_loss, {"mse_a": mse_a, "mse_n": mse_n}, baseline
        )
        info = {
            "side": 16,
            "A_range": AMPLITUDE_RANGE,
            "n_range": INDEX_RANGE,
            "k_pivot": K_PIVOT,
            "target_mean": arrays["target_mean"],
            "target_std": arrays["target_std"],
            "field_variance_min_median_max": arrays["field_variance"],
            "baseline_mse": baseline,
        }
    dataset_info = {
        "train": len(arrays["y_train"]),
        "test": len(arrays["y_test"]),
        "zarr": str(root / name),
        "prepare_seconds": time.perf_counter() - started,
        **info,
    }
    print(
        f"{name}: {dataset_info['train']} train / {dataset_info['test']} test samples, "
        f"written to zarr and read back with ZarrSource",
        flush=True,
    )
    dataset.info = dataset_info
    return dataset


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.fmean(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def summarize(name: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Mean and spread per schedule; ratios and targets against fixed-small."""
    base = runs["fixed-small"]
    base_score = statistics.fmean(r["score"] for r in base)
    base_steps = statistics.fmean(r["steps"] for r in base)
    base_wall = statistics.fmean(r["train_seconds"] for r in base)
    rows, summary = [], {}
    for label, rs in runs.items():
        scores = [r["score"] for r in rs]
        steps = statistics.fmean(r["steps"] for r in rs)
        wall = [r["train_seconds"] for r in rs]
        entry = {
            "score_mean": statistics.fmean(scores),
            "score_min": min(scores),
            "score_max": max(scores),
            "score_stdev": statistics.stdev(scores) if len(scores) > 1 else 0.0,
            "steps_mean": steps,
            "train_seconds_mean": statistics.fmean(wall),
            "train_seconds_min": min(wall),
            "train_seconds_max": max(wall),
            "score_drop_points": base_score - statistics.fmean(scores),
            "fewer_steps": base_steps / steps,
            "less_wall": base_wall / statistics.fmean(wall),
            "final_batch": [r["phases"][-1]["global_batch"] for r in rs],
        }
        if label in ("stepwise", "adaptive"):
            entry["targets"] = {
                "within_0.5_points": entry["score_drop_points"] <= 0.5,
                "steps_4x": entry["fewer_steps"] >= 4.0,
                "wall_1.5x": entry["less_wall"] >= 1.5,
            }
        summary[label] = entry
        rows.append(
            [
                label,
                spread(scores),
                f"{entry['score_drop_points']:+.2f}",
                f"{steps:.0f}",
                f"{entry['fewer_steps']:.2f}x",
                spread(wall),
                f"{entry['less_wall']:.2f}x",
                "/".join(str(b) for b in sorted(set(entry["final_batch"]))),
            ]
        )
    unit = "accuracy %" if name == "digits" else "R^2 %"
    header = [
        name,
        f"{unit} mean (min..max)",
        "drop",
        "steps",
        "fewer steps",
        "train s mean (min..max)",
        "less wall",
        "final B",
    ]
    print(table(rows, header), flush=True)
    return summary


def print_phases(label: str, run: dict[str, Any]) -> None:
    parts = []
    for p in run["phases"]:
        noise = p["measured_noise_scale"]
        parts.append(
            f"e{p['start_epoch']}:B={p['global_batch']},lr={p['lr']:.3g}"
            + (f",Bnoise={noise:.0f}" if noise is not None else "")
        )
    print(f"    {label}: " + " ".join(parts), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 1 seed, few epochs, small data"
    )
    p.add_argument(
        "--datasets", default="digits,cosmo", help="comma-separated: digits, cosmo (both)"
    )
    p.add_argument("--seeds", type=int, default=None, help="seeds per schedule (3; quick: 1)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per fit (20; quick: 6)")
    p.add_argument("--warmup-steps", type=int, default=5, help="LR ramp at each phase change (5)")
    p.add_argument("--lr-digits", type=float, default=DEFAULT_LR["digits"], help="lr0 at B0=16")
    p.add_argument("--lr-cosmo", type=float, default=DEFAULT_LR["cosmo"], help="lr0 at B0=16")
    p.add_argument(
        "--tune",
        action="store_true",
        help="instead: sweep lr0 for fixed-small only (1 seed), to pick the defaults",
    )
    p.add_argument("--tune-lrs", default="0.003,0.01,0.03,0.1", help="the LRs --tune tries")
    p.add_argument("--out", help="JSON file (default benchmarks/results/schedules.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file instead of appending")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from dataflow.runtime.cluster import client_or_local_cluster

    if __name__ != "__main__":  # imported (the smoke test): ship this module by value too
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ship_to_workers()
    seeds = args.seeds or (1 if args.quick else 3)
    epochs = args.epochs or (6 if args.quick else 20)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    lrs = {"digits": args.lr_digits, "cosmo": args.lr_cosmo}
    load = os.getloadavg()
    print(
        f"{NAME}: {'tune' if args.tune else 'compare'}, {epochs} epochs, "
        f"{1 if args.tune else seeds} seed(s), "
        f"B0={B0}, Bmax={BMAX}, 2 replicas; load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    started = time.perf_counter()
    record: dict[str, Any] = {
        "mode": "tune" if args.tune else ("quick" if args.quick else "full"),
        "args": vars(args),
        "epochs": epochs,
        "seeds": seeds,
        "B0": B0,
        "Bmax": BMAX,
        "load_average_start": load,
        "datasets": {},
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        client_or_local_cluster(None, n_workers=2, announce=False) as client,
    ):
        for name in names:
            dataset = prepare(name, Path(tmp), args.quick)
            if args.tune:
                tune = {}
                for lr in (float(v) for v in args.tune_lrs.split(",")):
                    from dataflow.schedule import Fixed

                    run = fit_one(dataset, Fixed(B0), lr, epochs, 0, client)
                    tune[str(lr)] = run
                    print(
                        f"  fixed-small lr0={lr}: score {run['score']:.2f}, "
                        f"train loss {run['final_train_loss']:.4f}",
                        flush=True,
                    )
                record["datasets"][name] = {"info": dataset.info, "tune": tune}
                continue
            plans = schedules(epochs, lrs[name], args.warmup_steps)
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in plans}
            for seed in range(seeds):  # seeds outermost: machine load drifts over all runs
                for label, (schedule, lr) in plans.items():
                    run = fit_one(dataset, schedule, lr, epochs, seed, client)
                    run["seed"] = seed
                    runs[label].append(run)
                    print(
                        f"  seed {seed} {label:<11}: score {run['score']:6.2f}, "
                        f"{run['steps']:4d} steps, {run['train_seconds']:5.1f} s",
                        flush=True,
                    )
                    if seed == 0 and label in ("stepwise", "adaptive"):
                        print_phases(label, run)
            summary = summarize(name, runs)
            record["datasets"][name] = {
                "info": dataset.info,
                "lr0": lrs[name],
                "schedules": {label: repr(s) for label, (s, _) in plans.items()},
                "lrs": {label: lr for label, (_, lr) in plans.items()},
                "runs": runs,
                "summary": summary,
            }
    record["load_average_end"] = os.getloadavg()
    record["seconds"] = time.perf_counter() - started
    if not args.tune:
        print_verdict(record)
    print(
        f"total {record['seconds']:.0f} s; load average at the end "
        f"{record['load_average_end'][0]:.2f}",
        flush=True,
    )
    path = save_run(NAME, record, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return record


def print_verdict(record: dict[str, Any]) -> None:
    """Per target: met or missed, for each growing schedule on each dataset."""
    met_anywhere = {"stepwise": False, "adaptive": False}
    verdict: dict[str, Any] = {}
    for name, data in record["datasets"].items():
        for label in ("stepwise", "adaptive"):
            entry = data["summary"][label]
            t = entry["targets"]
            print(
                f"{name} {label}: accuracy {'MET' if t['within_0.5_points'] else 'MISSED'} "
                f"(drop {entry['score_drop_points']:+.2f} points, target <= 0.5), steps "
                f"{'MET' if t['steps_4x'] else 'MISSED'} ({entry['fewer_steps']:.2f}x fewer, "
                f"target >= 4x), wall {'MET' if t['wall_1.5x'] else 'MISSED'} "
                f"({entry['less_wall']:.2f}x less, target >= 1.5x)"
            )
            if all(t.values()):
                met_anywhere[label] = True
    for label, met in met_anywhere.items():
        verdict[label] = met
        print(f"{label}: all three targets met on at least one dataset: {'YES' if met else 'NO'}")
    record["verdict_all_targets_on_one_dataset"] = verdict


if __name__ == "__main__":
    main()
