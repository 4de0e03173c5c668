"""What ``sync_batchnorm=True`` costs: a BatchNorm CNN on 2 CPU replicas, with the
replicas' statistics reduced every forward (and the adjoint every backward) against
each replica normalising by its own batch, in the same run.

A 4-block conv + BatchNorm + ReLU network (16 channels) on 1 x 32 x 32 inputs, SGD,
``Fixed(--batch)``, split 1:1 and 1:3 (``Proportional``): each side runs ``--repeats``
fits, interleaved, on one LocalCluster of 2 single-threaded workers; the steady
samples/s of each fit (driver wall time after the first ``--warmup`` steps) and the
median ratio synced / apart. Each BatchNorm layer adds one allreduce of ``2C`` float64
sums forward and one of ``2C`` floats backward, on the compute thread: their latency, not
their bytes, is the cost (8 small collectives a step here).

    python benchmarks/bench_sync_batchnorm.py          # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from measure import steady_boundary, steady_fit
from records import machine_info, save_run, table

import dataflow as dfl

NAME = "sync_batchnorm"


class BlocksCNN(torch.nn.Module):
    def __init__(self, channels: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        c_in = 1
        for b in range(blocks):
            stride = 2 if b else 1
            layers += [
                torch.nn.Conv2d(c_in, channels, 3, stride=stride, padding=1, bias=False),
                torch.nn.BatchNorm2d(channels),
                torch.nn.ReLU(),
            ]
            c_in = channels
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--out", help="JSON file (default benchmarks/results/sync_batchnorm.json)")
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def one_fit(args: argparse.Namespace, client: Any, split: tuple[int, int], synced: bool) -> float:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 1, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, size=args.samples).astype(np.int64)
    pipe = dfl.Pipeline(
        model=BlocksCNN,
        loss=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(args.batch),
        balancer=dfl.balance.Proportional(split),
        device="cpu",
        replicas=2,
        progress=False,
        sync_batchnorm=synced,
    )
    steps = pipe.fit(args.epochs, client=client).history.steps
    return steady_fit(steps, steady_boundary(steps, args.warmup)).samples_per_second


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from distributed import Client, LocalCluster

    rows, figures = [], {}
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        one_fit(args, client, (1, 1), True)  # warm-up: the workers' first imports
        for split in ((1, 1), (1, 3)):
            runs: dict[str, list[float]] = {"apart": [], "synced": []}
            for _ in range(args.repeats):
                runs["apart"].append(one_fit(args, client, split, False))
                runs["synced"].append(one_fit(args, client, split, True))
            ratios = [s / a for s, a in zip(runs["synced"], runs["apart"], strict=True)]
            label = f"{split[0]}:{split[1]}"
            figures[label] = {**runs, "ratio_median": statistics.median(ratios)}
            rows.append(
                [
                    label,
                    f"{statistics.median(runs['apart']):.0f}",
                    f"{statistics.median(runs['synced']):.0f}",
                    f"{statistics.median(ratios):.3f}",
                ]
            )
    print(table(rows, ["split", "apart samples/s", "synced samples/s", "synced / apart"]))
    run = {"config": vars(args), "splits": figures, "machine": machine_info()}
    path = save_run(NAME, run, args.out, overwrite=args.overwrite)
    print(f"\nsaved to {path}")
    return run


if __name__ == "__main__":
    main()
