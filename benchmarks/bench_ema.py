"""What the weights' moving average (``ema_decay=``) is worth on a test set.

The four datasets of ``bench_adaptive_heldout.py`` (digits, cosmo, signals, gratings:
2D, 3D and 1D data, classification and regression), SGD and Adam at that script's tuned
``LR0``, ``Fixed(16)`` on 2 replicas, ``--epochs`` (15: the horizon ``LR0`` was tuned
for). One fit per seed keeps the average; its held-out set is split in two, the
*validation* half scored every epoch (``eval_loss`` and ``eval_ema_loss``, by the fit),
the *test* half once after the fit, by ``Pipeline.evaluate``, for:

* ``final``: the last weights (``result.model``);
* ``ema``: their moving average (``result.ema_model``).

The score is test accuracy (%) or mean R^2 (%), as in ``bench_adaptive_heldout.py``.
Means over seeds (model init and data order), paired differences seed for seed.

    python benchmarks/bench_ema.py                 # 3 seeds, decay 0.99, ~5 min on 2 cores
    python benchmarks/bench_ema.py --decay 0.999   # a longer average
    python benchmarks/bench_ema.py --quick         # 1 seed, 4 epochs, less data
    python benchmarks/bench_ema.py --warmup        # ema_warmup=True
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

NAME = "ema"
B0 = 16


def fit_once(
    dataset: Dataset,
    kind: str,
    seed: int,
    epochs: int,
    decay: float,
    client: Any,
    warmup: bool = False,
) -> dict[str, Any]:
    pipe, test = validated_pipeline(dataset, kind, seed, B0, ema_decay=decay, ema_warmup=warmup)
    started = time.perf_counter()
    result = pipe.fit(epochs, client=client)

    def scored(model: Any) -> float:
        return test_score(dataset, test, pipe.evaluate(test, model, client=client))

    last = result.history.epochs[-1]
    return {
        "final": scored(result.model),
        "ema": scored(result.ema_model),
        "eval_loss": float(last["eval_loss"]),
        "eval_ema_loss": float(last["eval_ema_loss"]),
        "steps": len(result.history.steps),
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = grid_parser(__doc__, NAME, epochs=15)
    p.add_argument("--decay", type=float, default=0.99, help="ema_decay (0.99)")
    p.add_argument("--warmup", action="store_true", help="ema_warmup=True")
    args = p.parse_args(argv)
    seeds, epochs = grid_size(args, 15)
    warmed = ", warmup" if args.warmup else ""
    print(f"{NAME}: decay {args.decay}{warmed}, {epochs} epochs, {seeds} seed(s)")

    def fit(dataset: Dataset, kind: str, seed: int, client: Any) -> dict[str, Any]:
        return fit_once(dataset, kind, seed, epochs, args.decay, client, args.warmup)

    def report(run: dict[str, Any]) -> str:
        return (
            f"final {run['final']:6.2f}  ema {run['ema']:6.2f}  (validation loss "
            f"{run['eval_loss']:.4f} -> {run['eval_ema_loss']:.4f}; {run['steps']} steps) "
            f"{run['seconds']:.0f} s"
        )

    results = run_grid(args, seeds, __name__, fit, report)
    rows = [
        [
            *key.split("/"),
            f"{statistics.fmean(r['final'] for r in runs):.2f}",
            f"{statistics.fmean(r['ema'] for r in runs):.2f}",
            paired(runs, "ema", "final"),
            f"{statistics.fmean(r['steps'] for r in runs):.0f}",
        ]
        for key, runs in results.items()
    ]
    header = ["dataset", "opt", "final", "ema", "ema - final", "steps"]
    print(
        f"test scores (%), mean over {seeds} seed(s); {epochs} epochs; decay {args.decay}"
        f"{warmed}; differences paired"
    )
    print(table(rows, header))
    return save_grid(NAME, args, results, seeds, epochs)


if __name__ == "__main__":
    main()
