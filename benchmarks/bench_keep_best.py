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

import statistics
import time
from typing import Any

from bench_adaptive_heldout import Dataset
from heldout_grid import (
    grid_parser,
    grid_size,
    paired,
    run_grid,
    save_grid,
    test_score,
    validated_pipeline,
)
from records import table

NAME = "keep_best"
B0 = 16


def fit_pair(
    dataset: Dataset, kind: str, seed: int, epochs: int, patience: int, client: Any
) -> dict[str, Any]:
    import dataflow as dfl

    pipe, test = validated_pipeline(dataset, kind, seed, B0)
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


def epoch_range(epochs: list[int]) -> str:
    return f"{min(epochs)}-{max(epochs)}" if min(epochs) != max(epochs) else str(epochs[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = grid_parser(__doc__, NAME, epochs=30)
    p.add_argument("--patience", type=int, default=5, help="EarlyStopping's patience")
    args = p.parse_args(argv)
    seeds, epochs = grid_size(args, 30)
    print(f"{NAME}: {epochs} epochs, {seeds} seed(s), patience {args.patience}")

    def fit(dataset: Dataset, kind: str, seed: int, client: Any) -> dict[str, Any]:
        return fit_pair(dataset, kind, seed, epochs, args.patience, client)

    def report(run: dict[str, Any]) -> str:
        return (
            f"final {run['final']:6.2f}  best {run['best']:6.2f} (epoch {run['best_epoch']})  "
            f"early {run['early']:6.2f} ({run['early_epochs']} epochs)  {run['seconds']:.0f} s"
        )

    results = run_grid(args, seeds, __name__, fit, report)
    rows = []
    for key, runs in results.items():
        rows.append(
            [
                *key.split("/"),
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
    return save_grid(NAME, args, results, seeds, epochs)


if __name__ == "__main__":
    main()
