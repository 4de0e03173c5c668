"""What FusedLARS and FusedLAMB are worth when the batch grows: test scores, seeds paired.

The four datasets of ``bench_adaptive_heldout.py`` (digits, cosmo, signals, gratings:
2D, 3D and 1D data, classification and regression), 2 CPU replicas, ``--epochs`` (15).
Per dataset, optimizer kind and seed, three fits:

* ``small``: ``Fixed(32)``, SGD (momentum 0.9) or Adam at the script's tuned ``LR0``:
  the small-batch score to keep;
* ``grown``: ``Stepwise`` from 32 to ``--max-batch`` (512) in three phases, the LR
  scaled with the batch (linear for SGD, square root for Adam; ``--warmup`` steps),
  the same optimizer;
* ``layerwise``: the same schedule with ``FusedLARS`` (for SGD; momentum 0.9, weight
  decay 0, trust coefficient 0.001) or ``FusedLAMB`` (for Adam; weight decay 0), at one
  base LR for every dataset (``--lars-lr``, ``--lamb-lr``: the best of ``--tune`` on
  digits alone with ``exclude_1d=True``, so three of the four datasets are data nobody
  tuned it to; ``--tune`` sweeps both forms);
* ``layerwise_all``: the same with ``exclude_1d=False``: biases (and BatchNorm's scales
  and shifts, where a model has them) take the trust ratio too, instead of the plain
  step at the layer-wise optimizer's global LR.

``--batchnorm``: each model with a BatchNorm after every convolution (as in
``bench_sync_batchnorm_accuracy.py``), the networks the ``exclude_1d`` recipe is for.

Each fit is scored once on the test half of its held-out set (the validation half is
scored each epoch), as in ``bench_sync_batchnorm_accuracy.py``: test accuracy (%) or
mean R^2 (%). A fit that diverges (its loss or a held-out metric not finite) scores as
a constant predictor would (0 % R^2; the most frequent class's share) and is listed in
its run's ``diverged``. Means over seeds, paired differences seed for seed.

    python benchmarks/bench_layerwise_accuracy.py --seeds 5          # ~15 min on 2 cores
    python benchmarks/bench_layerwise_accuracy.py --tune --datasets digits --seeds 1
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_adaptive_heldout import LR0, Dataset
from heldout_grid import (
    grid_parser,
    grid_size,
    halves,
    paired,
    run_grid,
    test_score,
    validated_pipeline,
)
from records import save_run, table

from dataflow.errors import DataError, NonFiniteError

NAME = "layerwise_accuracy"
VARIANTS = ("small", "grown", "layerwise")
TUNE_LRS = {"sgd": (0.3, 1.0, 3.0, 10.0), "adam": (0.003, 0.01, 0.03, 0.1)}


class Layerwise:
    """Picklable ``params -> FusedLARS(lr)`` (kind "sgd") or ``FusedLAMB(lr)`` ("adam")."""

    def __init__(self, kind: str, lr: float, exclude_1d: bool = True) -> None:
        self.kind, self.lr, self.exclude_1d = kind, lr, exclude_1d

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        from dataflow.ops import FusedLAMB, FusedLARS

        if self.kind == "sgd":
            return FusedLARS(params, lr=self.lr, momentum=0.9, exclude_1d=self.exclude_1d)
        return FusedLAMB(params, lr=self.lr, weight_decay=0.0, exclude_1d=self.exclude_1d)


def grown_schedule(kind: str, epochs: int, max_batch: int, warmup: int) -> Any:
    """32, then sqrt(max / 32) x 32, then ``max_batch``, at a third and two thirds of
    the epochs; the LR follows (linear for SGD, square root for Adam)."""
    import dataflow as dfl

    middle = round((32 * max_batch) ** 0.5)
    steps = {0: 32, epochs // 3: middle, 2 * epochs // 3: max_batch}
    scaling = "linear" if kind == "sgd" else "sqrt"
    return dfl.schedule.Stepwise(steps, lr_scaling=scaling, warmup_steps=warmup)


def constant_score(dataset: Dataset, test: Any) -> float:
    """What a fit that diverged scores: a constant predictor's test score (0 % R^2, the
    training mean; or the most frequent test class's share, %)."""
    if dataset.baseline_mse is not None:
        return 0.0
    counts = np.bincount(test.y.numpy())
    return 100.0 * float(counts.max()) / float(counts.sum())


def fit_variants(
    dataset: Dataset, kind: str, seed: int, args: Any, epochs: int, client: Any, lrs: dict
) -> dict[str, Any]:
    run: dict[str, Any] = {}
    started = time.perf_counter()
    grown = grown_schedule(kind, epochs, args.max_batch, args.warmup)
    variants: dict[str, dict[str, Any]] = (
        {} if args.tune else {"small": {}, "grown": {"schedule": grown}}
    )
    for lr in lrs[kind]:
        at = "" if not args.tune else f"@{lr:g}"
        variants[f"layerwise{at}"] = {"schedule": grown, "optimizer": Layerwise(kind, lr)}
        # the same with biases and norms adapted too (the optimizers' default)
        variants[f"layerwise_all{at}"] = {
            "schedule": grown,
            "optimizer": Layerwise(kind, lr, exclude_1d=False),
        }
    for name, options in variants.items():
        pipe, test = validated_pipeline(dataset, kind, seed, 32, **options)
        try:
            result = pipe.fit(epochs, client=client)
            scores = pipe.evaluate(test, result.model, client=client)
        except (NonFiniteError, DataError) as exc:  # the loss or a metric overflowed
            run[name] = constant_score(dataset, test)
            run.setdefault("diverged", []).append(name)
            print(f"    {name} diverged ({type(exc).__name__}): scored as a constant predictor")
            continue
        run[name] = test_score(dataset, test, scores)
        if name == "grown":
            run["batches"] = [p["global_batch"] for p in result.history.phases]
            run["lrs"] = [round(p["lr"], 6) for p in result.history.phases]
    run["floor"] = constant_score(dataset, halves(dataset.test)[1])
    run["seconds"] = time.perf_counter() - started
    return run


SCORES = ("small", "grown", "layerwise", "layerwise_all")
PAIRS = (("grown", "small"), ("layerwise", "grown"), ("layerwise_all", "grown"))


def floored(run: dict[str, Any]) -> dict[str, float]:
    """The run's scores, each at least a constant predictor's (``run["floor"]``): a
    regression worse than predicting the mean counts as the mean (R^2 0 %), so one
    blown-up fit (R^2 of -1e37) does not decide a mean over seeds."""
    floor = run.get("floor", float("-inf"))
    return {
        k: max(v, floor)
        for k, v in run.items()
        if isinstance(v, float) and k not in ("seconds", "floor")
    }


def summarize(
    results: dict[str, list[dict[str, Any]]], *, tune: bool, seeds: int, epochs: int
) -> None:
    """The table of mean (floored) scores and paired differences, and the totals."""
    rows = []
    for key, raw in results.items():
        dataset, kind = key.split("/")
        runs = [floored(r) for r in raw]
        names = list(runs[0])
        means = [f"{statistics.fmean(r[v] for r in runs):.2f}" for v in names]
        diverged = sum(len(r.get("diverged", ())) for r in raw)
        if tune:
            means = ["  ".join(f"{n} {m}" for n, m in zip(names, means, strict=True))]
            rows.append([dataset, kind, f"{LR0[(dataset, kind)]:g}", *means])
            continue
        diffs = [paired(runs, a, b) for a, b in PAIRS]
        rows.append([dataset, kind, f"{LR0[(dataset, kind)]:g}", *means, *diffs, diverged])
    header = ["dataset", "opt", "LR0"]
    header += (
        ["layerwise@LR: score"]
        if tune
        else [*SCORES, *(f"{a} - {b}" for a, b in PAIRS), "diverged"]
    )
    print(f"test scores (%; floored at a constant predictor's), mean over {seeds} seed(s); "
          f"{epochs} epochs; differences paired")  # fmt: skip
    print(table(rows, header))
    if tune:
        return
    for kind in ("sgd", "adam"):
        runs = [floored(r) for key, rs in results.items() if key.endswith(kind) for r in rs]
        for a, b in PAIRS:
            print(f"  {kind}, all datasets, {a} - {b}: {paired(runs, a, b)}") if runs else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = grid_parser(__doc__, NAME, epochs=15)
    p.add_argument("--max-batch", type=int, default=512, help="the last phase's batch (512)")
    p.add_argument("--warmup", type=int, default=3, help="LR warmup steps per phase (3)")
    p.add_argument("--lars-lr", type=float, default=1.0, help="FusedLARS's base LR at 32")
    p.add_argument("--lamb-lr", type=float, default=0.01, help="FusedLAMB's base LR at 32")
    p.add_argument("--tune", action="store_true", help="sweep the layerwise LRs instead")
    p.add_argument(
        "--batchnorm", action="store_true", help="each model with a BatchNorm after every conv"
    )
    p.add_argument("--summarize", metavar="JSON", help="print the last run saved there, only")
    args = p.parse_args(argv)
    if args.summarize:
        import json

        last = json.loads(Path(args.summarize).read_text())["runs"][-1]
        config = last["config"]
        summarize(last["runs"], tune=config["tune"], seeds=config["seeds"], epochs=config["epochs"])
        return last
    seeds, epochs = grid_size(args, 15)
    lrs = TUNE_LRS if args.tune else {"sgd": (args.lars_lr,), "adam": (args.lamb_lr,)}
    print(f"{NAME}: 32 -> {args.max_batch}, {epochs} epochs, {seeds} seed(s), layerwise LRs {lrs}")

    def fit(dataset: Dataset, kind: str, seed: int, client: Any) -> dict[str, Any]:
        if args.batchnorm:
            import dataclasses

            from bench_sync_batchnorm_accuracy import WithBatchNorm

            dataset = dataclasses.replace(dataset, model=WithBatchNorm(dataset.model))
        return fit_variants(dataset, kind, seed, args, epochs, client, lrs)

    def report(run: dict[str, Any]) -> str:
        diverged = f"  diverged: {', '.join(run['diverged'])}" if "diverged" in run else ""
        scores = "  ".join(
            f"{k} {v:6.2f}" for k, v in run.items() if isinstance(v, float) and k != "seconds"
        )
        return f"{scores}  {run['seconds']:.0f} s{diverged}"

    results = run_grid(args, seeds, __name__, fit, report)
    summarize(results, tune=args.tune, seeds=seeds, epochs=epochs)
    config = vars(args) | {"epochs": epochs, "seeds": seeds, "layerwise_lrs": lrs}
    record = {"config": config, "runs": results}
    path = save_run(NAME, record, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return record


if __name__ == "__main__":
    main()
