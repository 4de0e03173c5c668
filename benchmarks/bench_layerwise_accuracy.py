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
from typing import Any

import torch
from bench_adaptive_heldout import LR0, Dataset
from heldout_grid import (
    floored,
    grid_parser,
    grid_size,
    last_saved,
    paired,
    report_scores,
    run_grid,
    save_grid,
    scored_variants,
)
from records import table

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


def grown_table(epochs: int, max_batch: int) -> dict[int, int]:
    """32, then sqrt(32 x ``max_batch``), then ``max_batch``, at a third and two thirds
    of the epochs (``bench_stepwise_heldout.py`` grows the same table)."""
    middle = round((32 * max_batch) ** 0.5)
    return {0: 32, epochs // 3: middle, 2 * epochs // 3: max_batch}


def grown_schedule(kind: str, epochs: int, max_batch: int, warmup: int) -> Any:
    """:func:`grown_table`, the LR following the batch (linear for SGD, square root for
    Adam)."""
    import dataflow as dfl

    scaling = "linear" if kind == "sgd" else "sqrt"
    table = grown_table(epochs, max_batch)
    return dfl.schedule.Stepwise(table, lr_scaling=scaling, warmup_steps=warmup)


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
    results = scored_variants(dataset, kind, seed, epochs, client, variants, run)
    if "grown" in results:
        phases = results["grown"].history.phases
        run["batches"] = [p["global_batch"] for p in phases]
        run["lrs"] = [round(p["lr"], 6) for p in phases]
    run["seconds"] = time.perf_counter() - started
    return run


SCORES = ("small", "grown", "layerwise", "layerwise_all")
PAIRS = (("grown", "small"), ("layerwise", "grown"), ("layerwise_all", "grown"))


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
        last = last_saved(args.summarize)
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

    results = run_grid(args, seeds, __name__, fit, report_scores)
    summarize(results, tune=args.tune, seeds=seeds, epochs=epochs)
    return save_grid(NAME, args, results, seeds, epochs, layerwise_lrs=lrs)


if __name__ == "__main__":
    main()
