"""Handwritten digits (real data) with the adaptive batch size: schedule.Adaptive.

scikit-learn's bundled digits (1797 8x8 images, 10 classes, no download) are split
80/20, written to zarr (``dataflow.io.to_zarr``) and streamed back
(``dataflow.io.ZarrSource``) while a small CNN trains data-parallel on a Dask cluster.
``schedule.Adaptive`` starts at a global batch of 16 and, at each epoch boundary,
measures the gradient noise scale and grows the batch towards it (at most x2 per
epoch, up to --max-batch), the LR following by AdaScale's gain (docs/adaptive.md).

The quality figure is the held-out test accuracy; the bar is >= 95% (--bar).

    python examples/digits.py                     # about 1 min on 2 cores (~98% accuracy)
    python examples/digits.py --epochs 40 --max-batch 512 --workers 4
    python examples/digits.py --scheduler tcp://head-node:8786

Needs scikit-learn (``pip install -e '.[examples]'``). Writes OUT/history.json and
OUT/result.json (the figures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dataflow as dfl
from dataflow.runtime.cluster import client_or_local_cluster
from dataflow.tools.datasets import digits_arrays


class DigitsNet(torch.nn.Module):
    """Two 3x3 convs, a 2x2 max-pool and a two-layer head: about 40k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 4 * 4, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=20, help="epochs = Adaptive phases (20)")
    p.add_argument("--batch", type=int, default=16, help="the first global batch (16)")
    p.add_argument("--max-batch", type=int, default=256, help="Adaptive's largest batch (256)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD LR at the first batch (0.01)")
    p.add_argument(
        "--lr-rule",
        default="adascale",
        choices=("adascale", "linear", "sqrt", "none"),
        help="how the LR follows the batch (adascale)",
    )
    p.add_argument("--warmup-steps", type=int, default=5, help="LR ramp at each new batch (5)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order (0)")
    p.add_argument("--split-seed", type=int, default=0, help="the train/test split (0)")
    p.add_argument("--workers", type=int, default=2, help="LocalCluster workers = replicas (2)")
    p.add_argument("--scheduler", help="address of a running Dask scheduler (instead)")
    p.add_argument("--out", default="runs/digits", help="output folder (runs/digits)")
    p.add_argument("--bar", type=float, default=0.95, help="pass if test accuracy >= BAR (0.95)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    # 1. real data to zarr (small chunks: the epoch shuffle permutes chunks, then mixes
    # samples across a few chunks, so 32 samples per chunk shuffle well)
    data = digits_arrays(seed=args.split_seed)
    sources = {}
    for part in ("train", "test"):
        x, y = data[f"x_{part}"], data[f"y_{part}"]
        path = dfl.io.to_zarr(out / "data" / f"{part}.zarr", x, y, chunk_mb=32 * x[0].nbytes / 1e6)
        sources[part] = dfl.io.ZarrSource(path, x="x", y="y", shuffle=part == "train")
    print(
        f"digits: {len(data['y_train'])} train / {len(data['y_test'])} test images of 8x8, "
        f"in {out / 'data'}"
    )

    # 2. the fit
    schedule = dfl.schedule.Adaptive(
        args.batch,
        max_batch=args.max_batch,
        lr_rule=args.lr_rule,
        warmup_steps=args.warmup_steps,
    )
    lr = args.lr
    pipe = dfl.Pipeline(
        model=DigitsNet,
        loss=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        source=sources["train"],
        eval_source=sources["test"],
        metrics={"loss": F.cross_entropy, "accuracy": dfl.stages.accuracy},
        schedule=schedule,
        seed=args.seed,
        progress=not args.no_progress,
    )
    # A running scheduler (--scheduler), else a LocalCluster of --workers processes.
    with client_or_local_cluster(args.scheduler, n_workers=args.workers) as client:
        result = pipe.fit(epochs=args.epochs, client=client)
    history = result.history
    history.to_json(out / "history.json")

    # 3. the figures
    accuracy = float(history.epochs[-1]["eval_accuracy"])
    passed = accuracy >= args.bar
    phases = [
        {
            "start_epoch": p["start_epoch"],
            "global_batch": p["global_batch"],
            "lr": p["lr"],
            "noise_scale": p["noise_scale"],
        }
        for p in history.phases
    ]
    record = {
        "example": "digits",
        "test_accuracy": accuracy,
        "bar": args.bar,
        "passed": passed,
        "accuracy_per_epoch": [e["eval_accuracy"] for e in history.epochs],
        "phases": phases,
        "final_batch": history.phases[-1]["global_batch"],
        "steps": len(history.steps),
        "train_seconds": history.info.get("train_seconds"),
        "seconds": time.perf_counter() - started,
        "args": vars(args),
    }
    (out / "result.json").write_text(json.dumps(record, indent=1))

    print("global batch per epoch (Adaptive):", " ".join(str(p["global_batch"]) for p in phases))
    print(
        f"digits: {len(history.steps)} steps, batch {args.batch} -> {record['final_batch']}; "
        f"test accuracy {100 * accuracy:.1f}% (bar >= {100 * args.bar:.0f}%): "
        f"{'PASS' if passed else 'FAIL'}"
    )
    return record


if __name__ == "__main__":
    main()
