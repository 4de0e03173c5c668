"""What the held-out grids share (``bench_keep_best.py``, ``bench_ema.py``,
``bench_sync_batchnorm_accuracy.py``, ``bench_layerwise_accuracy.py``,
``bench_stepwise_heldout.py``): the grid of datasets (those of
``bench_adaptive_heldout.py``), optimizers and seeds, each fit scored on a test half of
the held-out set that nothing was chosen by, a diverged fit scored as a constant
predictor, the paired differences, and the saved record."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from bench_adaptive_heldout import DATASETS, LR0, OPTIMIZERS, Dataset, prepare
from records import save_run
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


def constant_score(dataset: Dataset, test: Any) -> float:
    """What a fit that diverged scores: a constant predictor's test score (0 % R^2, the
    training mean; or the most frequent test class's share, %)."""
    if dataset.baseline_mse is not None:
        return 0.0
    counts = np.bincount(test.y.numpy())
    return 100.0 * float(counts.max()) / float(counts.sum())


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


def scored_variants(
    dataset: Dataset,
    kind: str,
    seed: int,
    epochs: int,
    client: Any,
    variants: dict[str, dict[str, Any]],
    run: dict[str, Any],
) -> dict[str, Any]:
    """Each variant (name -> ``validated_pipeline`` options, a global batch of 32) fitted
    and scored on the test half into ``run[name]``; a fit whose loss or held-out metric
    overflowed scores as a constant predictor and is listed in ``run["diverged"]``. Also
    ``run["floor"]``. Returns each fitted variant's result (the diverged left out)."""
    from dataflow.errors import DataError, NonFiniteError

    results = {}
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
        results[name] = result
    run["floor"] = constant_score(dataset, halves(dataset.test)[1])
    return results


def report_scores(run: dict[str, Any]) -> str:
    """One run's line: every score, its seconds, the variants that diverged."""
    diverged = f"  diverged: {', '.join(run['diverged'])}" if "diverged" in run else ""
    scores = "  ".join(
        f"{k} {v:6.2f}" for k, v in run.items() if isinstance(v, float) and k != "seconds"
    )
    return f"{scores}  {run['seconds']:.0f} s{diverged}"


def last_saved(path: str) -> dict[str, Any]:
    """The last run a grid saved at ``path`` (for ``--summarize``)."""
    return json.loads(Path(path).read_text())["runs"][-1]


def save_grid(
    name: str,
    args: argparse.Namespace,
    results: dict[str, list[dict[str, Any]]],
    seeds: int,
    epochs: int,
    **config: Any,
) -> dict[str, Any]:
    """The grid's record (its arguments, seeds, epochs and ``config``; every run) appended
    to ``results/<name>.json`` (or ``--out``); returns it."""
    record = {"config": vars(args) | {"epochs": epochs, "seeds": seeds, **config}}
    record["runs"] = results
    path = save_run(name, record, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return record


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
