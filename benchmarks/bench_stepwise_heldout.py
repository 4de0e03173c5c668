"""Does a grown batch keep the small batch's score, and by which LR rule? Test scores on
four kinds of data, seeds paired.

The four datasets of ``bench_adaptive_heldout.py`` (digits, cosmo, signals, gratings:
2D, 3D and 1D data, classification and regression), 2 CPU replicas, ``--epochs`` (15),
SGD (momentum 0.9) and Adam at the script's tuned ``LR0`` for a batch of 32. Per
dataset, optimizer and seed, one fit per variant:

* ``small``: ``Fixed(32)``: the score to keep;
* the same ``Stepwise`` table for every other variant: 32, then sqrt(32 x
  ``--max-batch``), then ``--max-batch`` (512), at a third and two thirds of the
  epochs, ``--warmup`` steps of LR warmup a phase, the LR scaled from LR0 by
  ``lr_scaling``:
  ``linear`` (Goyal et al.), ``sqrt``, ``none`` (Smith et al.: the batch grows in place
  of an LR decay), ``adascale`` and ``adascale-sqrt`` (AdaScale's gain from the
  gradient noise scale the engine measures; the square root for Adam-like optimizers);
  ``adascale-progress`` (``--rules``, not in the default set): ``adascale`` counting
  AdaScale's progress (``scale_invariant=True``), so the 15 epochs are of progress at
  32 and a grown phase trains the epochs of data its gain needs.

Nothing here was tuned to a variant: LR0 is the small batch's (tuned for
``bench_adaptive_heldout.py``, one per dataset and optimizer), and the table is the
one ``bench_layerwise_accuracy.py`` uses. Each fit is scored once on the test half of
its held-out set (the validation half is scored each epoch): test accuracy (%) or mean
R^2 (%); a fit that diverges scores as a constant predictor (listed in ``diverged``).
Means over seeds, paired differences seed for seed against ``small``.

    python benchmarks/bench_stepwise_heldout.py --seeds 5        # ~20 min on 2 cores
    python benchmarks/bench_stepwise_heldout.py --quick          # a smoke run, ~2 min
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench_adaptive_heldout import LR0, Dataset
from bench_layerwise_accuracy import grown_table
from heldout_grid import (
    floored,
    grid_parser,
    grid_size,
    last_saved,
    paired,
    report_scores,
    run_grid,
    save_grid,
    scored_variants,
)
from records import table

NAME = "stepwise_heldout"
RULES = ("linear", "sqrt", "none", "adascale", "adascale-sqrt")
# "<AdaScale rule>-progress": the same rule counting scale-invariant progress
# (Stepwise(scale_invariant=True)): the table and the fit's epochs are epochs at batch
# 32, a grown phase runs as many epochs of data as its measured gain needs
PROGRESS = "-progress"


def stepwise(epochs: int, max_batch: int, warmup: int, rule: str) -> Any:
    """``bench_layerwise_accuracy.grown_table``, the LR scaled by ``rule`` (counting
    progress for a rule ending in ``-progress``)."""
    import dataflow as dfl

    table = grown_table(epochs, max_batch)
    counts = rule.endswith(PROGRESS)
    return dfl.schedule.Stepwise(
        table,
        lr_scaling=rule.removesuffix(PROGRESS),
        warmup_steps=warmup,
        scale_invariant=counts,
    )


def fit_variants(
    dataset: Dataset, kind: str, seed: int, args: Any, epochs: int, client: Any
) -> dict[str, Any]:
    """Every variant's test score for one dataset, optimizer and seed, and what each
    grown fit chose: its phases' LR scales and the noise scales they came from."""
    run: dict[str, Any] = {"phases": {}}
    started = time.perf_counter()
    variants: dict[str, dict[str, Any]] = {"small": {}}
    for rule in args.rules.split(","):
        variants[rule] = {"schedule": stepwise(epochs, args.max_batch, args.warmup, rule)}
    results = scored_variants(dataset, kind, seed, epochs, client, variants, run)
    for name, result in results.items():
        if name != "small":
            run["phases"][name] = [
                {
                    "batch": p["global_batch"],
                    "lr_scale": round(p["lr"] / LR0[(dataset.name, kind)], 3),
                    "noise_scale": p.get("noise_scale"),
                    "epochs": p["end_epoch"] - p["start_epoch"],
                }
                for p in result.history.phases
            ]
    run["seconds"] = time.perf_counter() - started
    return run


def data_steps(phases: list[dict[str, Any]], epochs: int) -> float:
    """A grown fit's steps relative to ``Fixed(32)``'s over ``epochs`` (each phase's
    epochs of data x 32/B; the epochs' last short steps left out)."""
    return sum(p["epochs"] * 32 / p["batch"] for p in phases) / epochs


def summarize(results: dict[str, list[dict[str, Any]]], *, seeds: int, epochs: int) -> None:
    """Mean (floored) scores per dataset and optimizer, differences to ``small`` paired
    seed for seed, and over all datasets per optimizer."""
    rows = []
    names: list[str] = []
    for key, raw in results.items():
        dataset, kind = key.split("/")
        runs = [floored(r) for r in raw]
        names = [n for n in runs[0] if n != "small"]
        means = [f"{statistics.fmean(r['small'] for r in runs):.2f}"]
        means += [paired(runs, n, "small") for n in names]
        diverged = sum(len(r.get("diverged", ())) for r in raw)
        rows.append([dataset, kind, f"{LR0[(dataset, kind)]:g}", *means, diverged])
    print(f"test scores (%; floored at a constant predictor's): small's mean, each rule - "
          f"small paired over {seeds} seed(s); {epochs} epochs")  # fmt: skip
    print(table(rows, ["dataset", "opt", "LR0", "small", *names, "diverged"]))
    counting = [n for n in names if n.endswith(PROGRESS)]
    for name in counting:  # what counting progress cost: epochs of data, steps
        print(f"{name}: epochs of data and steps / Fixed(32)'s, mean (range) over seeds")
        for key, raw in results.items():
            epochs_of_data = [sum(p["epochs"] for p in r["phases"][name]) for r in raw]
            steps = [data_steps(r["phases"][name], epochs) for r in raw]
            print(f"  {key:14s} {statistics.fmean(epochs_of_data):5.1f} "
                  f"({min(epochs_of_data)}-{max(epochs_of_data)})  "
                  f"{statistics.fmean(steps):.2f} ({min(steps):.2f}-{max(steps):.2f})")  # fmt: skip
    for kind in ("sgd", "adam"):
        runs = [floored(r) for key, rs in results.items() if key.endswith(kind) for r in rs]
        for name in names if runs else ():
            worst = min(r[name] - r["small"] for r in runs)
            print(f"  {kind}, all datasets, {name} - small: {paired(runs, name, 'small')} "
                  f"(worst {worst:+.2f})")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = grid_parser(__doc__, NAME, epochs=15)
    p.add_argument("--max-batch", type=int, default=512, help="the last phase's batch (512)")
    p.add_argument("--warmup", type=int, default=3, help="LR warmup steps per phase (3)")
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated lr_scaling rules")
    p.add_argument("--summarize", metavar="JSON", help="print the last run saved there, only")
    args = p.parse_args(argv)
    if args.summarize:
        last = last_saved(args.summarize)
        summarize(last["runs"], seeds=last["config"]["seeds"], epochs=last["config"]["epochs"])
        return last
    seeds, epochs = grid_size(args, 15)
    print(f"{NAME}: 32 -> {args.max_batch}, {epochs} epochs, {seeds} seed(s), {args.rules}")

    def fit(dataset: Dataset, kind: str, seed: int, client: Any) -> dict[str, Any]:
        return fit_variants(dataset, kind, seed, args, epochs, client)

    results = run_grid(args, seeds, __name__, fit, report_scores)
    summarize(results, seeds=seeds, epochs=epochs)
    return save_grid(NAME, args, results, seeds, epochs)


if __name__ == "__main__":
    main()
