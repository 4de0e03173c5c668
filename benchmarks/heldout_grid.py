"""What ``bench_keep_best.py`` and ``bench_ema.py`` share: the grid of datasets (those
of ``bench_adaptive_heldout.py``), optimizers and seeds, each fit scored on a test half
of the held-out set that nothing was chosen by, and the paired differences."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

from bench_adaptive_heldout import DATASETS, LR0, OPTIMIZERS, Dataset, prepare
from workloads import Optimizer, ship_to_workers


def halves(source: Any) -> tuple[Any, Any]:
    """The held-out set split in two, in its order: validation, test."""
    from dataflow.io import ArraySource

    half = source.num_samples // 2
    x, y = source.x.numpy(), source.y.numpy()
    return (
        ArraySource(x[:half], y[:half], shuffle=False),
        ArraySource(x[half:], y[half:], shuffle=False),
    )


def validated_pipeline(
    dataset: Dataset, kind: str, seed: int, batch: int, **options: Any
) -> tuple[Any, Any]:
    """The grid's fit of ``dataset`` with optimizer ``kind``: 2 CPU replicas at
    ``Fixed(batch)``, evaluated on the validation half of the held-out set each epoch;
    ``options``: more of the Pipeline's (or others: ``schedule=``, ``optimizer=``).
    Returns the pipeline and the test half."""
    import dataflow as dfl

    validation, test = halves(dataset.test)
    defaults = dict(
        model=dataset.model,
        loss=dataset.loss,
        optimizer=Optimizer(kind, LR0[(dataset.name, kind)]),
        source=dataset.train,
        eval_source=validation,
        metrics={k: v for k, v in dataset.metrics.items() if k != "loss"},
        schedule=dfl.schedule.Fixed(batch),
        seed=seed,
        replicas=2,
        progress=False,
        device="cpu",
    )
    return dfl.Pipeline(**{**defaults, **options}), test


def test_score(dataset: Dataset, test: Any, scores: dict[str, float]) -> float:
    """Test accuracy (%) or mean R^2 (%) against predicting the training mean (0: the
    targets are standardised) on the test half."""
    if dataset.baseline_mse is None:
        return 100 * scores["accuracy"]
    y = test.y.numpy()
    baseline = [float((y[:, j] ** 2).mean()) for j in range(y.shape[1])]
    return 100 * statistics.fmean(1 - scores[f"mse_{j}"] / b for j, b in enumerate(baseline))


def paired(runs: list[dict[str, Any]], a: str, b: str) -> str:
    """The mean of ``a - b`` over the runs, seed for seed, ± its standard deviation."""
    diffs = [r[a] - r[b] for r in runs]
    spread = f" ± {statistics.stdev(diffs):.2f}" if len(diffs) > 1 else ""
    return f"{statistics.fmean(diffs):+.2f}{spread}"


def grid_parser(description: str, name: str, epochs: int) -> argparse.ArgumentParser:
    """The grid's options (a benchmark adds its own): seeds, epochs, datasets, output."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1 seed, 4 epochs, less data")
    p.add_argument("--seeds", type=int, default=None, help="seeds (3; quick: 1)")
    p.add_argument("--epochs", type=int, default=None, help=f"epochs ({epochs}; quick: 4)")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated subset")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="sgd, adam or both")
    p.add_argument("--out", help=f"JSON file (default benchmarks/results/{name}.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file, not append")
    return p


def grid_size(args: argparse.Namespace, epochs: int) -> tuple[int, int]:
    """(seeds, epochs) as asked, or the defaults (``--quick``: 1 seed, 4 epochs)."""
    return args.seeds or (1 if args.quick else 3), args.epochs or (4 if args.quick else epochs)


def run_grid(
    args: argparse.Namespace,
    seeds: int,
    module: str,
    fit: Callable[[Dataset, str, int, Any], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
) -> dict[str, list[dict[str, Any]]]:
    """``fit(dataset, optimizer kind, seed, client)`` for every dataset, optimizer and
    one of ``seeds`` seeds, on a 2-worker LocalCluster, each run printed
    (``report(run)``) as it ends; the runs by ``"dataset/kind"``. ``module``: the
    calling benchmark's, shipped to the workers by value when it was imported (a smoke
    test) rather than run."""
    from dataflow.runtime.cluster import client_or_local_cluster

    if module != "__main__":
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[module])
    ship_to_workers()
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    kinds = [k.strip() for k in args.optimizers.split(",") if k.strip()]
    print(f"  load {os.getloadavg()[0]:.1f}")
    results: dict[str, list[dict[str, Any]]] = {}
    with client_or_local_cluster(None, n_workers=2, announce=False) as client:
        for name in names:
            dataset = prepare(name, args.quick)
            for kind in kinds:
                runs = results[f"{name}/{kind}"] = []
                for seed in range(seeds):
                    run = fit(dataset, kind, seed, client)
                    runs.append(run)
                    print(f"  {name:<9} {kind:<5} seed {seed}: {report(run)}", flush=True)
    return results
