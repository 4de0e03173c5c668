"""What keeping the best epoch's weights is worth on a test set nobody chose them by.

The four datasets of ``bench_adaptive_heldout.py`` (digits, cosmo, signals, gratings:
2D, 3D and 1D data, classification and regression), SGD and Adam at that script's tuned
``LR0``, ``Fixed(16)`` on 2 replicas. Each dataset's held-out set is split in two: the
*validation* half is the fit's ``eval_source``, scored every epoch, and
``keep_best="eval_loss"`` keeps the weights of the epoch with the lowest validation loss;
the *test* half is scored once after the fit, by ``Pipeline.evaluate``, for:

* ``final``: the last epoch's weights (``result.model``);
* ``best``: the kept weights (``result.best_model``);
* ``early``: the kept weights of a second fit, the same but stopped by
  ``EarlyStopping("eval_loss", patience=P)`` (its epochs trained are reported).

The epochs run to twice the horizon ``LR0`` was tuned for (15), as a user who trains
too long would; the score is test accuracy (%) or mean R^2 (%), as in
``bench_adaptive_heldout.py``. Means over seeds (model init and data order), paired
differences seed for seed.

    python benchmarks/bench_keep_best.py               # 3 seeds, ~15 min on 2 idle cores
    python benchmarks/bench_keep_best.py --quick       # 1 seed, 4 epochs, less data
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from bench_adaptive_heldout import DATASETS, LR0, OPTIMIZERS, Dataset, prepare
from records import save_run, table
from workloads import Optimizer, ship_to_workers

NAME = "keep_best"
B0 = 16


def halves(source: Any) -> tuple[Any, Any]:
    """The held-out set split in two, in its order: validation, test."""
    from dataflow.io import ArraySource

    half = source.num_samples // 2
    x, y = source.x.numpy(), source.y.numpy()
    return (
        ArraySource(x[:half], y[:half], shuffle=False),
        ArraySource(x[half:], y[half:], shuffle=False),
    )


def test_score(dataset: Dataset, test: Any, scores: dict[str, float]) -> float:
    """Test accuracy (%) or mean R^2 (%) against predicting the training mean (0: the
    targets are standardised) on the test half."""
    if dataset.baseline_mse is None:
        return 100 * scores["accuracy"]
    y = test.y.numpy()
    baseline = [float((y[:, j] ** 2).mean()) for j in range(y.shape[1])]
    return 100 * statistics.fmean(1 - scores[f"mse_{j}"] / b for j, b in enumerate(baseline))


def fit_pair(
    dataset: Dataset, kind: str, seed: int, epochs: int, patience: int, client: Any
) -> dict[str, Any]:
    import dataflow as dfl

    validation, test = halves(dataset.test)
    pipe = dfl.Pipeline(
        model=dataset.model,
        loss=dataset.loss,
        optimizer=Optimizer(kind, LR0[(dataset.name, kind)]),
        source=dataset.train,
        eval_source=validation,
        metrics={k: v for k, v in dataset.metrics.items() if k != "loss"},
        schedule=dfl.schedule.Fixed(B0),
        seed=seed,
        replicas=2,
        progress=False,
        device="cpu",
    )
    started = time.perf_counter()
    full = pipe.fit(epochs, client=client, keep_best="eval_loss")
    stop = dfl.EarlyStopping(metric="eval_loss", patience=patience)
    early = pipe.fit(epochs, client=client, keep_best="eval_loss", on_epoch=stop)

    def scored(model: Any) -> float:
        return test_score(dataset, test, pipe.evaluate(test, model, client=client))

    return {
        "final": scored(full.model),
        "best": scored(full.best_model),
        "early": scored(early.best_model),
        "best_epoch": full.history.info["best"]["epoch"],
        "early_epochs": len(early.history.epochs),
        "early_best_epoch": early.history.info["best"]["epoch"],
        "seconds": time.perf_counter() - started,
    }


def paired(runs: list[dict[str, Any]], a: str, b: str) -> str:
    diffs = [r[a] - r[b] for r in runs]
    spread = f" ± {statistics.stdev(diffs):.2f}" if len(diffs) > 1 else ""
    return f"{statistics.fmean(diffs):+.2f}{spread}"


def epoch_range(epochs: list[int]) -> str:
    return f"{min(epochs)}-{max(epochs)}" if min(epochs) != max(epochs) else str(epochs[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1 seed, 4 epochs, less data")
    p.add_argument("--seeds", type=int, default=None, help="seeds (3; quick: 1)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (30; quick: 4)")
    p.add_argument("--patience", type=int, default=5, help="EarlyStopping's patience")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated subset")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="sgd, adam or both")
    p.add_argument("--out", help=f"JSON file (default benchmarks/results/{NAME}.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file, not append")
    args = p.parse_args(argv)
    from dataflow.runtime.cluster import client_or_local_cluster

    if __name__ != "__main__":  # imported (a smoke test): ship this module by value too
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ship_to_workers()
    seeds = args.seeds or (1 if args.quick else 3)
    epochs = args.epochs or (4 if args.quick else 30)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    kinds = [k.strip() for k in args.optimizers.split(",") if k.strip()]
    load = os.getloadavg()[0]
    print(f"{NAME}: {epochs} epochs, {seeds} seed(s), patience {args.patience}, load {load:.1f}")
    results: dict[str, list[dict[str, Any]]] = {}
    rows = []
    with client_or_local_cluster(None, n_workers=2, announce=False) as client:
        for name in names:
            dataset = prepare(name, args.quick)
            for kind in kinds:
                runs = []
                for seed in range(seeds):
                    run = fit_pair(dataset, kind, seed, epochs, args.patience, client)
                    runs.append(run)
                    print(
                        f"  {name:<9} {kind:<5} seed {seed}: final {run['final']:6.2f}  "
                        f"best {run['best']:6.2f} (epoch {run['best_epoch']})  early "
                        f"{run['early']:6.2f} ({run['early_epochs']} epochs)  "
                        f"{run['seconds']:.0f} s",
                        flush=True,
                    )
                results[f"{name}/{kind}"] = runs
                rows.append(
                    [
                        name,
                        kind,
                        f"{statistics.fmean(r['final'] for r in runs):.2f}",
                        f"{statistics.fmean(r['best'] for r in runs):.2f}",
                        paired(runs, "best", "final"),
                        epoch_range([r["best_epoch"] for r in runs]),
                        f"{statistics.fmean(r['early'] for r in runs):.2f}",
                        paired(runs, "early", "final"),
                        f"{statistics.fmean(r['early_epochs'] for r in runs):.1f}",
                    ]
                )
    header = [
        "dataset", "opt", "final", "best", "best - final", "best epoch",
        "early", "early - final", "early epochs",
    ]  # fmt: skip
    print(f"test scores (%), mean over {seeds} seed(s); {epochs} epochs; differences paired")
    print(table(rows, header))
    record = {"config": vars(args) | {"epochs": epochs, "seeds": seeds}, "runs": results}
    path = save_run(NAME, record, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return record


if __name__ == "__main__":
    main()
