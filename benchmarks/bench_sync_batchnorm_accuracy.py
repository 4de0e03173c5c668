"""What ``sync_batchnorm=True`` is worth on a test set, where a slow node's share is small.

The four datasets of ``bench_adaptive_heldout.py`` (digits, cosmo, signals, gratings:
2D, 3D and 1D data, classification and regression), their models with a BatchNorm
after every convolution, SGD and Adam at that script's tuned ``LR0``, ``Fixed(--batch)``
on 2 replicas, ``--epochs`` (15: the horizon ``LR0`` was tuned for). Per seed, three
fits on the same global batches:

* ``even``: split 1:1, each replica's BatchNorm over its own half (DDP without
  SyncBatchNorm);
* ``uneven``: split ``--split`` (1:7 by default: what ``Throughput()`` gives a node
  seven times slower), each replica over its own share, the small one's a few samples;
* ``synced``: the same split with ``sync_batchnorm=True``: BatchNorm over the global
  batch, as one process.

Each is scored once on the test half of its held-out set (``Pipeline.evaluate``; the
validation half is scored by the fit each epoch, as in ``bench_ema.py``). The score is
test accuracy (%) or mean R^2 (%), as in ``bench_adaptive_heldout.py``. Means over
seeds (model init and data order), paired differences seed for seed.

    python benchmarks/bench_sync_batchnorm_accuracy.py            # 3 seeds, ~20 min
    python benchmarks/bench_sync_batchnorm_accuracy.py --quick    # 1 seed, 4 epochs
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
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

NAME = "sync_batchnorm_accuracy"
VARIANTS = ("even", "uneven", "synced")


class WithBatchNorm:
    """A model factory: ``model()`` with a BatchNorm after each convolution (1-3 d)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self) -> torch.nn.Module:
        model = self.model()
        norms = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.modules.conv._ConvNd):
                    norm = norms[len(child.kernel_size)](child.out_channels)
                    setattr(parent, name, torch.nn.Sequential(child, norm))
        return model


def fit_variants(
    dataset: Dataset, kind: str, seed: int, epochs: int, batch: int, split: tuple, client: Any
) -> dict[str, Any]:
    import dataclasses

    import dataflow as dfl

    normed = dataclasses.replace(dataset, model=WithBatchNorm(dataset.model))
    run: dict[str, Any] = {}
    started = time.perf_counter()
    for variant in VARIANTS:
        shares = (1, 1) if variant == "even" else split
        pipe, test = validated_pipeline(
            normed,
            kind,
            seed,
            batch,
            balancer=dfl.balance.Proportional(shares),
            sync_batchnorm=variant == "synced",
        )
        result = pipe.fit(epochs, client=client)
        run[variant] = test_score(dataset, test, pipe.evaluate(test, result.model, client=client))
    run["local_batches"] = result.history.phases[0]["local_batches"]
    run["seconds"] = time.perf_counter() - started
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = grid_parser(__doc__, NAME, epochs=15)
    p.add_argument("--batch", type=int, default=32, help="the global batch (32)")
    p.add_argument("--split", default="1,7", help="the uneven split (1,7)")
    args = p.parse_args(argv)
    seeds, epochs = grid_size(args, 15)
    split = tuple(int(s) for s in args.split.split(","))
    print(f"{NAME}: batch {args.batch}, split {split}, {epochs} epochs, {seeds} seed(s)")

    def fit(dataset: Dataset, kind: str, seed: int, client: Any) -> dict[str, Any]:
        return fit_variants(dataset, kind, seed, epochs, args.batch, split, client)

    def report(run: dict[str, Any]) -> str:
        scores = "  ".join(f"{v} {run[v]:6.2f}" for v in VARIANTS)
        return f"{scores}  (uneven split {run['local_batches']})  {run['seconds']:.0f} s"

    results = run_grid(args, seeds, __name__, fit, report)
    rows = []
    for key, runs in results.items():
        means = [f"{statistics.fmean(r[v] for r in runs):.2f}" for v in VARIANTS]
        rows.append(
            [
                *key.split("/"),
                *means,
                paired(runs, "uneven", "even"),
                paired(runs, "synced", "uneven"),
                paired(runs, "synced", "even"),
            ]
        )
    header = [
        "dataset", "opt", *VARIANTS, "uneven - even", "synced - uneven", "synced - even",
    ]  # fmt: skip
    print(f"test scores (%), mean over {seeds} seed(s); {epochs} epochs; differences paired")
    print(table(rows, header))
    everything = [r for runs in results.values() for r in runs]
    for a, b in (("uneven", "even"), ("synced", "uneven"), ("synced", "even")):
        print(f"  all datasets and optimizers, {a} - {b}: {paired(everything, a, b)}")
    return save_grid(NAME, args, results, seeds, epochs, split=list(split))


if __name__ == "__main__":
    main()
