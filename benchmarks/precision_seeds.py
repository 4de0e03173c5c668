"""Is bf16 biased on the cosmo regression, or is the fit just that sensitive? Many seeds.

bench_precision.py found the 3-D cosmo regression's held-out R^2 10 points lower in
bf16 than in fp32 over 3 seeds, with a spread of the per-seed differences (11 points)
as large as the gap; a bf16 *allreduce* (fp32 compute, only the gradients rounded on
the wire) lost 8 points the same way. This script separates a bias from sensitivity:
one process, the examples' CosmoNet and bench_precision's cosmo settings (Adam 0.003,
batch 32, 512 / 256 fields), a hand-written torch loop (no engine), fp32 and bf16
autocast from the same init and data order per seed, over many seeds. It prints the
mean paired difference with its standard error: a bias shows as a mean several
standard errors from zero; sensitivity as a wide spread around zero.

    python benchmarks/precision_seeds.py                  # 12 seeds, 8 epochs (~2 min)
    python benchmarks/precision_seeds.py --epochs 20      # longer fits (~5 min)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from bench_precision import SETTINGS
from records import save_run, table
from workloads import CosmoNet

from dataflow.tools.datasets import cosmology_arrays

NAME = "precision_seeds"
COSMO = SETTINGS["cosmo"]  # bench_precision's: Adam, its LR, batch, train and test sizes


def fit(data: dict[str, torch.Tensor], bf16: bool, seed: int, epochs: int) -> float:
    """Held-out R^2 (%, mean over A and n) of one hand-written fit."""
    torch.manual_seed(seed)
    model = CosmoNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=COSMO["lr"])
    order = torch.Generator().manual_seed(seed)
    x, y = data["x_train"], data["y_train"]
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=order)
        for start in range(0, len(x), COSMO["batch"]):
            idx = perm[start : start + COSMO["batch"]]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x[idx])
            loss = torch.nn.functional.mse_loss(out.float(), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        mse = ((model(data["x_test"]) - data["y_test"]) ** 2).mean(0)
    baseline = ((data["y_test"] - y.mean(0)) ** 2).mean(0)
    return float(100 * (1 - mse / baseline).mean())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=12)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--out", help=f"JSON file (default benchmarks/results/{NAME}.json)")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    arrays = cosmology_arrays(COSMO["train"], COSMO["test"])
    data = {k: torch.tensor(arrays[k]) for k in ("x_train", "y_train", "x_test", "y_test")}
    started = time.perf_counter()
    scores = {
        side: [fit(data, side == "bf16", seed, args.epochs) for seed in range(args.seeds)]
        for side in ("fp32", "bf16")
    }
    diffs = [b - a for a, b in zip(scores["fp32"], scores["bf16"], strict=True)]
    mean, spread = statistics.fmean(diffs), statistics.stdev(diffs)
    stderr = spread / len(diffs) ** 0.5
    rows = [
        [side, f"{statistics.fmean(s):.2f}", f"{statistics.stdev(s):.2f}"]
        for side, s in scores.items()
    ]
    print(table(rows, ["side", "mean R^2 %", "std over seeds"]))
    print(
        f"cosmo, {args.epochs} epochs, {args.seeds} seeds: bf16 - fp32 = {mean:+.2f} points "
        f"(standard error {stderr:.2f}; std of the per-seed differences {spread:.2f}); "
        f"per seed {', '.join(f'{d:+.1f}' for d in diffs)}"
    )
    run = {
        "args": vars(args),
        "scores": scores,
        "diffs": diffs,
        "mean_diff": mean,
        "stderr": stderr,
        "diff_std": spread,
        "seconds": time.perf_counter() - started,
    }
    if not args.no_save:
        print("saved", save_run(NAME, run, args.out, overwrite=False))
    return run


if __name__ == "__main__":
    main()
