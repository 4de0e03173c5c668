"""What ``fit(on_epoch=...)`` costs: the same fit without callbacks, with one that does
nothing, and with ``EarlyStopping`` that never stops.

With callbacks the driver plans no step past an epoch's end before they ran on the
epoch: the replicas wait between epochs for one round trip to the driver (the commit
of the epoch's last window, the callbacks, the next epoch's plan). Without callbacks
the whole phase is planned at once. Same data, model, seed and cluster (2 workers, one
thread each, started before the fits): the benchmarks' shared CNN workload
(``workloads.py``). The modes alternate, ``--repeats`` times each; the figure is the
training time (``history.info["train_seconds"]``), best of the repeats, and its ratio
to the fit without callbacks.

    python benchmarks/bench_epoch_callbacks.py                 # ~1 min on 2 cores
    python benchmarks/bench_epoch_callbacks.py --samples 1024  # shorter epochs
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from records import save_run, table
from workloads import (
    CNNConfig,
    ModelFactory,
    OptimConfig,
    OptimizerFactory,
    make_data,
    ship_to_workers,
)

NAME = "epoch_callbacks"
MODEL = CNNConfig(in_channels=1, image=16, channels=(8,), hidden=16, classes=3)


def nothing(epoch: Any, history: Any) -> None:
    """A callback that does nothing: what remains is the engine's cost."""


def fit(args: argparse.Namespace, mode: str, client: Any) -> dict[str, Any]:
    import dataflow as dfl

    x, y = make_data(args.samples, MODEL)
    pipe = dfl.Pipeline(
        model=ModelFactory(MODEL),
        loss=torch.nn.functional.cross_entropy,
        optimizer=OptimizerFactory(OptimConfig(lr=0.02)),
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(args.batch),
        device="cpu",
        progress=False,
        dry_run=False,
    )
    on_epoch = {
        "none": None,
        "nothing": nothing,
        "early-stopping": dfl.EarlyStopping(metric="train_loss", patience=10**6),
    }[mode]
    history = pipe.fit(args.epochs, client=client, on_epoch=on_epoch).history
    return {
        "mode": mode,
        "train_seconds": history.info["train_seconds"],
        "steps": len(history.steps),
        "final_loss": history.epochs[-1]["train_loss"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=2048, help="samples per epoch")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help=f"JSON file (default benchmarks/results/{NAME}.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file, not append")
    args = p.parse_args(argv)
    from distributed import Client, LocalCluster

    ship_to_workers()
    modes = ("none", "nothing", "early-stopping")
    runs: list[dict[str, Any]] = []
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        fit(args, "none", client)  # warm-up: imports and first compiles on the workers
        for repeat in range(args.repeats):
            for mode in modes:
                run = fit(args, mode, client)
                run["repeat"] = repeat
                runs.append(run)
                print(f"  {mode:<15} {run['train_seconds']:6.2f} s", flush=True)
    best = {m: min(r["train_seconds"] for r in runs if r["mode"] == m) for m in modes}
    losses = {m: {r["final_loss"] for r in runs if r["mode"] == m} for m in modes}
    same = len(set().union(*losses.values())) == 1  # the callbacks change no number
    steps = runs[0]["steps"]
    rows = [
        [m, f"{best[m]:.2f}", f"{best[m] / best['none']:.3f}x",
         f"{(best[m] - best['none']) / args.epochs * 1e3:+.0f}"]
        for m in modes
    ]  # fmt: skip
    header = ["on_epoch", "train s (best)", "vs none", "ms per epoch"]
    print(f"{args.epochs} epochs x {steps // args.epochs} steps of {args.batch}, 2 replicas")
    print(table(rows, header))
    print(f"same final loss in every mode: {same}")
    record = {"config": vars(args), "runs": runs, "best_seconds": best, "same_loss": same}
    path = save_run(NAME, record, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return record


if __name__ == "__main__":
    main()
