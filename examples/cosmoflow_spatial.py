"""CosmoFlow on volumes that do not fit one worker: each sample split over 2 workers.

The task of ``examples/cosmoflow.py`` (a 3D CNN regresses the amplitude ``A`` and the
spectral index ``n`` of simulated log-normal matter fields) on volumes 64 times as
large: 64^3 fields at the resolution of its 16^3 ones, boxes four times as wide
(``dataflow.tools.datasets.cosmology_arrays(..., box=side / 16)``: same parameter ranges, the
pivot and the power per unit volume held in physical units). A per-worker memory budget
(``--memory-per-worker``) is smaller than one sample's training memory on one worker:
weights, gradients, buckets and Adam's moments plus what autograd keeps for backward,
as the layout model predicts it from the model's shapes
(``dataflow.planning.layout_choice.layout_model``). By default the budget lies halfway between
one sample on one worker and one sample split over two, so sample parallelism does not
fit and ``Layout(spatial=2)`` does: the two workers form one sample group, each reads
its half of every volume from a zarr store chunked along depth
(``to_zarr(..., spatial_chunks={1: side // 2})``), computes its half of every
convolution and pooling, exchanging halos with its partner, and the halves are
gathered before the dense head. The budget holds one sample per worker, so each step's
batch runs as micro-batches of one sample (``max_micro_batch``), gradients accumulated.
``--layout auto`` lets the layout model choose instead (it times the layers on the
driver first and picks the fastest layout that fits).

The net follows the CosmoFlow paper's (Mathuriya et al. 2018; the MLPerf HPC
reference), scaled down: four blocks of Conv3d 3x3x3 + LeakyReLU + MaxPool3d 2 with
8, 16, 32, 32 channels, then flatten and a dense head 64 -> 32 -> 2 with dropout.
``--batchnorm`` adds a BatchNorm3d after each convolution (partitioned too: its
statistics are reduced over the group); at micro-batches of one sample its training
statistics are one field's own, which removes the amplitude (the field's variance)
and differ from the running statistics used at evaluation, so it is off by default
(use it with a budget that holds several samples).

The quality figure is each parameter's held-out MSE against the predict-the-mean
baseline (the training set's mean, which is 0 after standardisation), evaluated on
held-out fields every epoch under the same layout; the bar is MSE <= --bar x baseline
for both parameters (0.3, as cosmoflow.py; the default run reaches about 0.05-0.1).

    python examples/cosmoflow_spatial.py                          # about 3-4 min on 2 cores
    python examples/cosmoflow_spatial.py --layout auto            # the layout model chooses
    python examples/cosmoflow_spatial.py --side 128 --train 1024 --workers 8 \\
        --memory-per-worker 100MiB                                # bigger: 4 groups of 2
    python examples/cosmoflow_spatial.py --scheduler tcp://head-node:8786

Writes OUT/history.json (everything the fit measured) and OUT/result.json (the figures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dataflow as dfl
from dataflow.costmodel.layout_candidates import LayoutCandidate
from dataflow.planning.layout_choice import layout_model, parse_bytes
from dataflow.runtime.cluster import client_or_local_cluster
from dataflow.tools.datasets import cosmology_arrays

PARAMS = ("A", "n")  # amplitude, spectral index
MIB = 1 << 20
BLOCKS = 4  # conv blocks, each halving the side: the side must divide by 2**BLOCKS


class CosmoFlowNet(torch.nn.Module):
    """log1p of the density contrast, four conv blocks (Conv3d + [BatchNorm3d] +
    LeakyReLU + MaxPool3d), flatten, a dense head with dropout: every layer one that
    ``dataflow.spatial`` partitions (docs/spatial.md)."""

    def __init__(self, side: int, width: int = 8, batchnorm: bool = False) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        channels = 1
        for k in range(BLOCKS):
            out = width * 2 ** min(k, 2)  # 8, 16, 32, 32
            layers.append(torch.nn.Conv3d(channels, out, 3, padding=1))
            if batchnorm:
                layers.append(torch.nn.BatchNorm3d(out))
            layers += [torch.nn.LeakyReLU(0.2), torch.nn.MaxPool3d(2)]
            channels = out
        last = side // 2**BLOCKS
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(channels * last**3, 64),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(64, 32),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Linear(32, len(PARAMS)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in the model, so training and evaluation see the same input (pointwise: each
        # worker takes the log of its own region)
        return self.head(self.features(torch.log1p(x)))


def mse_A(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((output[:, 0] - y[:, 0]) ** 2).mean()


def mse_n(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((output[:, 1] - y[:, 1]) ** 2).mean()


def parse_table(text: str) -> dict[int, int]:
    """'0:16,4:32' -> {0: 16, 4: 32}."""
    try:
        table = {int(e): int(b) for e, b in (part.split(":") for part in text.split(","))}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--batches {text!r}: give EPOCH:BATCH pairs separated by commas, e.g. 0:16,4:32"
        ) from exc
    return table


def parse_side(text: str) -> int:
    side = int(text)
    if side < 2**BLOCKS or side % 2**BLOCKS:
        raise argparse.ArgumentTypeError(
            f"--side {text}: a multiple of {2**BLOCKS} (each of the {BLOCKS} blocks halves it)"
        )
    return side


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--train", type=int, default=256, help="training fields (256)")
    p.add_argument("--test", type=int, default=96, help="held-out fields (96)")
    p.add_argument(
        "--side", type=parse_side, default=64, help="grid cells per side, a multiple of 16 (64)"
    )
    p.add_argument("--epochs", type=int, default=7, help="epochs (7)")
    p.add_argument(
        "--batches",
        type=parse_table,
        default=None,
        help="the Stepwise table EPOCH:BATCH,... (default: 16, then 32 from half the "
        "epochs: 0:16,3:32 for 7 epochs)",
    )
    p.add_argument(
        "--optimizer", default="adam", choices=("adam", "sgd"), help="adam, or sgd (momentum 0.9)"
    )
    p.add_argument("--lr", type=float, default=0.001, help="LR at the first batch (0.001)")
    p.add_argument(
        "--lr-scaling",
        default="none",
        choices=dfl.schedule.STEPWISE_LR_RULES,
        help="how the LR follows the batch (none: the larger batch only lowers the noise)",
    )
    p.add_argument("--warmup-steps", type=int, default=5, help="LR ramp at each new batch (5)")
    p.add_argument("--width", type=int, default=8, help="channels of the first conv (8)")
    p.add_argument(
        "--batchnorm", action="store_true", help="BatchNorm3d after each conv (see above)"
    )
    p.add_argument(
        "--memory-per-worker",
        default=None,
        help="each worker's memory budget, e.g. 24MiB (default: halfway between one "
        "sample's training memory on one worker and split over two)",
    )
    p.add_argument(
        "--layout",
        default="spatial=2",
        choices=("spatial=2", "auto"),
        help="spatial=2 (each sample split in depth over 2 workers), or auto (the layout "
        "model's choice under the budget)",
    )
    p.add_argument("--seed", type=int, default=0, help="model init and data order (0)")
    p.add_argument("--data-seed", type=int, default=0, help="the generated fields (0)")
    p.add_argument("--workers", type=int, default=2, help="LocalCluster workers (2)")
    p.add_argument("--scheduler", help="address of a running Dask scheduler (instead)")
    p.add_argument(
        "--out", default="runs/cosmoflow_spatial", help="output folder (runs/cosmoflow_spatial)"
    )
    p.add_argument(
        "--bar", type=float, default=0.3, help="pass if MSE <= BAR x baseline for both (0.3)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def default_table(epochs: int, batch: int) -> dict[int, int]:
    """``batch``, doubled from half the epochs."""
    return {0: batch, epochs // 2: 2 * batch} if epochs >= 2 else {0: batch}


def memory_figures(trainer, budget: int | None) -> dict:
    """One sample's training memory per worker, as the layout model predicts it from the
    model's shapes, on one worker and split in depth over two; the budget (default:
    halfway) and the micro-batch a worker of a spatial=2 group holds under it."""
    model = layout_model(trainer, calibrate=False)
    whole = model.memory_bytes(LayoutCandidate(groups=1), local_batch=1)
    split = model.memory_bytes(
        LayoutCandidate(groups=1, spatial=2, dims=(0,), grid=(2,)), local_batch=1
    )
    if budget is None:
        budget = (whole["total"] + split["total"]) // 2
    fixed = split["total"] - split["activations"]  # weights, gradients, optimizer: any batch
    micro = max(0, (budget - fixed) // split["activations"])
    return {
        "spatial1_bytes": whole["total"],
        "spatial2_bytes": split["total"],
        "spatial1": whole,
        "spatial2": split,
        "budget_bytes": budget,
        "micro_batch": micro,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    # 1. the dataset: generated, written to zarr chunked along depth, streamed back
    data = cosmology_arrays(args.train, args.test, args.side, args.data_seed, box=args.side / 16)
    sample_bytes = data["x_train"][0].nbytes
    half = args.side // 2
    stores = {}
    for part in ("train", "test"):
        stores[part] = dfl.io.to_zarr(
            out / "data" / f"{part}.zarr",
            data[f"x_{part}"],
            data[f"y_{part}"],
            x_name="density",
            y_name="params",
            chunk_mb=16 * sample_bytes / 2 / 1e6,  # 16 half-fields per chunk
            spatial_chunks={1: half},  # each worker reads its half of every field
        )
    del data["x_train"], data["x_test"]  # streamed from the stores from here on
    train = dfl.io.ZarrSource(stores["train"], x="density", y="params")
    test = dfl.io.ZarrSource(stores["test"], x="density", y="params", shuffle=False)
    low, mid, high = data["field_variance"]
    print(
        f"cosmoflow_spatial: {args.train} train / {args.test} test fields of {args.side}^3, "
        f"var(log density) {low:.2f}..{high:.2f} (median {mid:.2f}), in {out / 'data'}, "
        f"chunked in depth at {half}: {sample_bytes / MIB:.2f} MiB a field, "
        f"{sample_bytes / 2 / MIB:.2f} MiB read by each worker of a group"
    )

    # 2. the fit
    table = args.batches or default_table(args.epochs, 16)
    schedule = dfl.schedule.Stepwise(
        table, lr_scaling=args.lr_scaling, warmup_steps=args.warmup_steps
    )
    lr, use_adam = args.lr, args.optimizer == "adam"

    def optimizer(params):
        if use_adam:
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    side, width, batchnorm = args.side, args.width, args.batchnorm
    options = dict(
        model=lambda: CosmoFlowNet(side, width, batchnorm),
        loss=F.mse_loss,
        optimizer=optimizer,
        source=train,
        eval_source=test,
        metrics={"mse_A": mse_A, "mse_n": mse_n},
        schedule=schedule,
        seed=args.seed,
        progress=not args.no_progress,
    )
    # the memory figures: from the model's shapes alone (no cluster, nothing timed)
    memory = memory_figures(dfl.Pipeline(**options).trainer, parse_bytes(args.memory_per_worker))
    budget = memory["budget_bytes"]
    print(
        f"memory per worker for one sample (weights, gradients, buckets, optimizer state, "
        f"activations): {memory['spatial1_bytes'] / MIB:.1f} MiB on one worker (spatial=1), "
        f"{memory['spatial2_bytes'] / MIB:.1f} MiB split over two (spatial=2); "
        f"budget {budget / MIB:.1f} MiB: spatial=1 "
        f"{'fits' if memory['spatial1_bytes'] <= budget else 'does not fit'}, spatial=2 "
        f"{'fits' if memory['spatial2_bytes'] <= budget else 'does not fit'}"
        + (f" ({memory['micro_batch']} sample(s) per micro-batch)" if memory["micro_batch"] else "")
    )
    layout = dfl.Layout(spatial=2) if args.layout == "spatial=2" else "auto"
    pipe = dfl.Pipeline(
        **options,
        layout=layout,
        memory_per_worker=budget,
        # the samples a worker of a spatial=2 group holds under the budget (a wider
        # split that --layout auto may choose holds at least as many)
        max_micro_batch=memory["micro_batch"] or None,
    )
    # A running scheduler (--scheduler), else a LocalCluster of --workers processes.
    with client_or_local_cluster(args.scheduler, n_workers=args.workers) as client:
        result = pipe.fit(epochs=args.epochs, client=client)
    history = result.history
    history.to_json(out / "history.json")
    chosen = history.info["layout"]
    candidates = history.info.get("layout_candidates") or []
    print(f"layout: {chosen}; the layout model's candidates, best first:")
    for c in candidates:
        print(
            f"  {c['layout']}: {c['memory_bytes'] / MIB:.1f} MiB per worker at "
            f"{c['local_batch']} sample(s) per group in {c['micro_batches']} micro-batch(es), "
            f"fits: {'yes' if c['fits'] else 'no'}"
        )

    # 3. the figures: per parameter, held-out MSE against predict-the-training-mean
    last = history.epochs[-1]
    std = data["target_std"]
    params = {}
    for j, name in enumerate(PARAMS):
        mse = float(last[f"eval_mse_{name}"])
        baseline = float((data["y_test"][:, j] ** 2).mean())  # the train mean is 0
        params[name] = {
            "mse": mse,
            "baseline_mse": baseline,
            "ratio": mse / baseline,
            "r2": 1.0 - mse / baseline,
            "rmse_physical": (mse**0.5) * std[j],  # in units of the parameter itself
            "baseline_rmse_physical": (baseline**0.5) * std[j],
        }
    passed = all(p["ratio"] <= args.bar for p in params.values())
    result_record = {
        "example": "cosmoflow_spatial",
        "params": params,
        "bar": args.bar,
        "passed": passed,
        "layout": chosen,
        "layout_candidates": [
            {k: c[k] for k in ("layout", "local_batch", "micro_batches", "memory_bytes", "fits")}
            for c in candidates
        ],
        "memory": {
            "sample_bytes": int(sample_bytes),
            "bytes_read_per_worker": int(sample_bytes // 2),
            "budget_bytes": int(budget),
            "spatial1_bytes": int(memory["spatial1_bytes"]),
            "spatial2_bytes": int(memory["spatial2_bytes"]),
            "spatial1": {k: int(v) for k, v in memory["spatial1"].items()},
            "spatial2": {k: int(v) for k, v in memory["spatial2"].items()},
            "micro_batch": int(memory["micro_batch"]),
        },
        "phases": [
            {"start_epoch": p["start_epoch"], "global_batch": p["global_batch"], "lr": p["lr"]}
            for p in history.phases
        ],
        "steps": len(history.steps),
        "train_seconds": history.info.get("train_seconds"),
        "seconds": time.perf_counter() - started,
        "args": {k: (str(v) if isinstance(v, dict) else v) for k, v in vars(args).items()},
    }
    (out / "result.json").write_text(json.dumps(result_record, indent=1))

    print(result.summary())
    for name, p in params.items():
        print(
            f"  {name}: held-out MSE {p['mse']:.3f} vs predict-the-mean {p['baseline_mse']:.3f} "
            f"(ratio {p['ratio']:.3f}, R^2 {p['r2']:.3f}; RMSE {p['rmse_physical']:.3f} vs "
            f"{p['baseline_rmse_physical']:.3f} in {name}'s units)"
        )
    print(
        f"cosmoflow_spatial: {chosen.split(':')[0]}, {memory['spatial2_bytes'] / MIB:.1f} MiB "
        f"per worker (one worker would need {memory['spatial1_bytes'] / MIB:.1f}; budget "
        f"{budget / MIB:.1f}); MSE / baseline A {params['A']['ratio']:.3f}, "
        f"n {params['n']['ratio']:.3f} (bar <= {args.bar}): {'PASS' if passed else 'FAIL'}"
    )
    return result_record


if __name__ == "__main__":
    main()
