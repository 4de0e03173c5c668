"""The ``dataflow`` command line: ``dataflow demo`` trains a small model end to end."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    import dataflow as dfl
    from dataflow.demo import SLOPES, FieldNet, random_fields
    from dataflow.runtime.cluster import client_or_local_cluster

    started = time.perf_counter()
    x, y = random_fields(args.samples + args.eval_samples, size=args.size, seed=args.seed)
    train = dfl.io.ArraySource(x[: args.samples], y[: args.samples])
    held_out = dfl.io.ArraySource(x[args.samples :], y[args.samples :], shuffle=False)
    print(
        f"dataflow demo: {args.samples} training and {args.eval_samples} held-out "
        f"{args.size}x{args.size} random fields, classes = power-spectrum slopes {SLOPES}"
    )
    pipe = dfl.Pipeline(
        model=FieldNet,
        loss=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        source=train,
        eval_source=held_out,
        metrics={"loss": F.cross_entropy, "accuracy": dfl.stages.accuracy},
        schedule=dfl.schedule.Fixed(args.batch),
        seed=args.seed,
        replicas=args.replicas,
    )
    with client_or_local_cluster(None, n_workers=args.workers) as client:
        result = pipe.fit(epochs=args.epochs, client=client)
    out = Path(args.out)
    path = result.history.to_json(out / "history.json")
    torch.save(result.model.state_dict(), out / "model.pt")
    accuracy = result.history.epochs[-1].get("eval_accuracy", float("nan"))
    print(
        f"held-out accuracy {accuracy:.1%} (chance {1 / len(SLOPES):.0%}); history in {path}, "
        f"weights in {out / 'model.pt'}; {time.perf_counter() - started:.0f} s in all"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataflow", description="CNN training as a task graph on a Dask cluster."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train a small CNN on synthetic random fields on a local Dask cluster",
        description="Makes a small dataset, starts a LocalCluster (one worker process per "
        "core), trains data-parallel with progress bars, and writes the history and weights.",
    )
    demo.add_argument("--epochs", type=int, default=6)
    demo.add_argument("--batch", type=int, default=64, help="global batch size")
    demo.add_argument("--lr", type=float, default=0.02)
    demo.add_argument("--samples", type=int, default=4000, help="training samples")
    demo.add_argument("--eval-samples", type=int, default=1000, help="held-out samples")
    demo.add_argument("--size", type=int, default=32, help="field side length in pixels")
    demo.add_argument("--workers", type=int, default=None, help="worker processes (default: cores)")
    demo.add_argument("--replicas", type=int, default=None, help="default: every worker")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="folder for history.json and model.pt")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
