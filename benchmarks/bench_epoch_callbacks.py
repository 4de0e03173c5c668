"""What watching each epoch costs: ``fit(on_epoch=...)`` and ``fit(keep_best=...)``,
against the same fit without either.

With callbacks the driver plans no step past an epoch's end before they ran on the
epoch: the replicas wait between epochs for one round trip to the driver (the commit
of the epoch's last window, the callbacks, the next epoch's plan). Without callbacks
the whole phase is planned at once. With ``keep_best`` a window ends at each epoch's
end and the replicas send their weights and buffers back with it (a host copy, and
the transfer to the driver); the driver keeps them when the epoch is the best, and with
a checkpoint folder writes ``best.pt`` (its own baseline: the same fit with the folder,
whose phase-end checkpoint it writes too).

Modes: ``none``; ``nothing`` (a callback that does nothing); ``early-stopping`` (one
that never stops); ``keep-best`` (``keep_best="train_loss"``, in memory; the training
loss falls almost every epoch, so nearly every epoch is kept); ``folder`` and
``keep-best-folder`` (the same two with ``checkpoint_dir``). Same data, model, seed and
cluster (2 workers, one thread each, started before the fits): the benchmarks' shared
CNN workload (``workloads.py``; ``--hidden`` widens its dense layer, e.g. 50000 for
25.7M parameters, a ResNet-50's count). The modes alternate, ``--repeats`` times each;
the figure is the training time (``history.info["train_seconds"]``), best of the
repeats, and its ratio to its baseline.

    python benchmarks/bench_epoch_callbacks.py                 # ~2 min on 2 cores
    python benchmarks/bench_epoch_callbacks.py --samples 1024  # shorter epochs
    python benchmarks/bench_epoch_callbacks.py --hidden 50000 --samples 512 --epochs 4 \
        --modes none keep-best folder keep-best-folder         # a 100 MB model
"""

from __future__ import annotations

import argparse
import tempfile
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
MODES = ("none", "nothing", "early-stopping", "keep-best", "folder", "keep-best-folder")
BASELINE = {"folder": "folder", "keep-best-folder": "folder"}  # (else "none")


def nothing(epoch: Any, history: Any) -> None:
    """A callback that does nothing: what remains is the engine's cost."""


def model_config(args: argparse.Namespace) -> CNNConfig:
    return CNNConfig(in_channels=1, image=16, channels=(8,), hidden=args.hidden, classes=3)


def fit(args: argparse.Namespace, mode: str, client: Any, folder: str) -> dict[str, Any]:
    import dataflow as dfl

    model = model_config(args)
    x, y = make_data(args.samples, model)
    pipe = dfl.Pipeline(
        model=ModelFactory(model),
        loss=torch.nn.functional.cross_entropy,
        optimizer=OptimizerFactory(OptimConfig(lr=0.02)),
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(args.batch),
        device="cpu",
        progress=False,
        dry_run=False,
    )
    on_epoch = {
        "nothing": nothing,
        "early-stopping": dfl.EarlyStopping(metric="train_loss", patience=10**6),
    }.get(mode)
    keep_best = "train_loss" if mode.startswith("keep-best") else None
    checkpoint_dir = folder if mode.endswith("folder") else None
    history = pipe.fit(
        args.epochs,
        client=client,
        on_epoch=on_epoch,
        keep_best=keep_best,
        checkpoint_dir=checkpoint_dir,
    ).history
    kept = history.info.get("best")
    return {
        "mode": mode,
        "train_seconds": history.info["train_seconds"],
        "steps": len(history.steps),
        "final_loss": history.epochs[-1]["train_loss"],
        "kept_epoch": None if kept is None else kept["epoch"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=2048, help="samples per epoch")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=16, help="the dense layer's width")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--out", help=f"JSON file (default benchmarks/results/{NAME}.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file, not append")
    args = p.parse_args(argv)
    from distributed import Client, LocalCluster

    ship_to_workers()
    modes = tuple(args.modes)
    runs: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as folder,
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        fit(args, "none", client, folder)  # warm-up: imports and first compiles
        for repeat in range(args.repeats):
            for mode in modes:
                run = fit(args, mode, client, folder)
                run["repeat"] = repeat
                runs.append(run)
                print(f"  {mode:<15} {run['train_seconds']:6.2f} s", flush=True)
    best = {m: min(r["train_seconds"] for r in runs if r["mode"] == m) for m in modes}
    losses = {m: {r["final_loss"] for r in runs if r["mode"] == m} for m in modes}
    same = len(set().union(*losses.values())) == 1  # the callbacks change no number
    steps = runs[0]["steps"]
    base = {m: BASELINE.get(m, "none") for m in modes if BASELINE.get(m, "none") in best}
    rows = [
        [m, f"{best[m]:.2f}", b, f"{best[m] / best[b]:.3f}x",
         f"{(best[m] - best[b]) / args.epochs * 1e3:+.0f}"]
        for m, b in base.items()
    ]  # fmt: skip
    header = ["mode", "train s (best)", "baseline", "vs baseline", "ms per epoch"]
    kept = sorted({r["kept_epoch"] for r in runs if r["kept_epoch"] is not None})
    print(
        f"{args.epochs} epochs x {steps // args.epochs} steps of {args.batch}, 2 replicas, "
        f"{sum(p.numel() for p in ModelFactory(model_config(args))().parameters()):,} "
        f"parameters; keep_best kept epoch(s) {kept}"
    )
    print(table(rows, header))
    print(f"same final loss in every mode: {same}")
    record = {"config": vars(args), "runs": runs, "best_seconds": best, "same_loss": same}
    path = save_run(NAME, record, args.out, overwrite=args.overwrite)
    print(f"saved {path}")
    return record


if __name__ == "__main__":
    main()
