"""Build the training graph by hand and add your own stage (gradient clipping).

The clipping stage sits between AllReduce and Update, so it sees the mean gradient
of the global batch, exactly as single-process training would: every replica clips
the same gradient by the same factor and the replicas stay identical. The stage
writes the norm before and after clipping of every step to a log per replica
(OUT/clip-rank<R>.jsonl, appended at the end of each phase: on a cluster, give --out a
folder every worker can write to). To clip without a stage of your own, pass
``clip_grad_norm=`` to ``Pipeline`` or ``stages.Update``; this stage shows how one of
yours sits in the graph, with a per-replica log of its own.

The example checks, from those logs: each replica logged every step, every replica
saw the same norms (the reduced gradient), the norm after clipping is <= --max-norm,
and some steps were clipped; and the held-out accuracy is >= --bar.

    python examples/custom_graph.py                      # about 30 s on 2 cores
    python examples/custom_graph.py --epochs 6 --samples 8000 --max-norm 0.25
    python examples/custom_graph.py --scheduler tcp://head-node:8786

Writes OUT/history.json and OUT/result.json (the figures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import dataflow as dfl
from dataflow import stages
from dataflow.runtime.cluster import client_or_local_cluster
from dataflow.tools.demo import FieldNet, random_fields


class ClipGradNorm(stages.Stage):
    """Clip the reduced gradient to ``max_norm``; log its norm before and after clipping."""

    def __init__(self, max_norm: float, log_dir: str | Path | None = None) -> None:
        super().__init__("ClipGradNorm")
        if not max_norm > 0:
            raise dfl.ConfigError(f"ClipGradNorm(max_norm={max_norm}): must be > 0")
        self.max_norm = max_norm
        # absolute: worker processes may run in another directory
        self.log_dir = None if log_dir is None else str(Path(log_dir).resolve())

    def setup(self, replica: stages.ReplicaContext) -> None:
        self._rows: list[dict[str, Any]] = []

    def run(self, step: stages.StepContext, grads: stages.Gradients) -> stages.Gradients:
        params = [p for p in step.replica.model.parameters() if p.grad is not None]
        before = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        self._rows.append({"step": step.spec.index, "before": float(before), "after": float(after)})
        return grads

    def end_phase(self, replica: stages.ReplicaContext) -> dict[str, Any]:
        rows, self._rows = self._rows, []
        if self.log_dir is not None:
            path = Path(self.log_dir) / f"clip-rank{replica.rank}.jsonl"
            with path.open("a") as log:
                log.writelines(json.dumps(row) + "\n" for row in rows)
        return {"clipped_steps": sum(row["before"] > self.max_norm for row in rows)}


def check_logs(out: Path, replicas: int, steps: int, max_norm: float) -> dict[str, Any]:
    """What the clipping logs show; ``ok`` is True when every check holds."""
    logs = []
    for rank in range(replicas):
        path = out / f"clip-rank{rank}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        logs.append(sorted(rows, key=lambda row: row["step"]))
    before = [[row["before"] for row in rows] for rows in logs]
    every_step = all([row["step"] for row in rows] == list(range(steps)) for rows in logs)
    spread = 0.0  # the largest relative difference from replica 0's norm at a step
    if every_step:
        for norms in before[1:]:
            for a, b in zip(norms, before[0], strict=True):
                spread = max(spread, abs(a - b) / max(abs(b), 1e-12))
    largest_after = max((row["after"] for rows in logs for row in rows), default=float("nan"))
    clipped = sum(b > max_norm for b in before[0]) if before else 0
    checks = {
        "every_replica_logged_every_step": every_step,
        "replicas_saw_the_same_norm": every_step and spread <= 1e-6,
        "norm_after_clipping_within_max_norm": largest_after <= max_norm * (1 + 1e-5),
        "some_steps_clipped": clipped > 0,
    }
    return {
        "checks": checks,
        "ok": all(checks.values()),
        "steps_logged": [len(rows) for rows in logs],
        "clipped_steps": clipped,
        "largest_norm_before": max(before[0], default=float("nan")),
        "median_norm_before": sorted(before[0])[len(before[0]) // 2] if before[0] else None,
        "largest_norm_after": largest_after,
        "relative_spread_between_replicas": spread,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=2, help="epochs (2)")
    p.add_argument("--samples", type=int, default=2500, help="fields: 80%% train, 20%% test")
    p.add_argument("--batch", type=int, default=64, help="global batch (64)")
    p.add_argument("--max-norm", type=float, default=0.5, help="clip the gradient norm to (0.5)")
    p.add_argument("--workers", type=int, default=2, help="LocalCluster workers = replicas (2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduler", help="address of a running Dask scheduler (instead)")
    p.add_argument("--out", default="runs/custom_graph", help="output folder")
    p.add_argument("--bar", type=float, default=0.9, help="pass if test accuracy >= BAR (0.9)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("clip-rank*.jsonl"):
        old.unlink()
    started = time.perf_counter()

    x, y = random_fields(args.samples, seed=args.seed)
    cut = int(0.8 * args.samples)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x[:cut], y[:cut])))
    output = g.add(stages.Forward(FieldNet, F.cross_entropy), batch)
    grads = g.add(stages.Backward(), output)
    reduced = g.add(stages.AllReduce(bucket_mb=25), grads)
    clipped = g.add(ClipGradNorm(args.max_norm, log_dir=out), reduced)
    update = g.add(stages.Update(lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9)), clipped)
    test = dfl.io.ArraySource(x[cut:], y[cut:], shuffle=False)
    g.add(stages.Evaluate(test, metrics={"accuracy": stages.accuracy}), update)
    print(g.to_dot())

    trainer = dfl.Trainer(
        g, schedule=dfl.schedule.Fixed(args.batch), seed=args.seed, progress=not args.no_progress
    )
    for plan in trainer.plan(epochs=args.epochs, replicas=args.workers, step_seconds=0.05):
        print(plan)
    with client_or_local_cluster(args.scheduler, n_workers=args.workers) as client:
        result = trainer.fit(epochs=args.epochs, client=client)
    history = result.history
    history.to_json(out / "history.json")

    clip = check_logs(out, args.workers, len(history.steps), args.max_norm)
    accuracy = float(history.epochs[-1]["eval_accuracy"])
    passed = clip["ok"] and accuracy >= args.bar
    record = {
        "example": "custom_graph",
        "clip": clip,
        "test_accuracy": accuracy,
        "last_loss": history.steps[-1]["loss"],
        "steps": len(history.steps),
        "bar": args.bar,
        "passed": passed,
        "seconds": time.perf_counter() - started,
        "args": vars(args),
    }
    (out / "result.json").write_text(json.dumps(record, indent=1))
    for name, ok in clip["checks"].items():
        print(f"  {'ok    ' if ok else 'FAILED'} {name.replace('_', ' ')}")
    print(
        f"custom_graph: clipped {clip['clipped_steps']} of {len(history.steps)} steps to norm "
        f"{args.max_norm} (norm before: median {clip['median_norm_before']:.2f}, largest "
        f"{clip['largest_norm_before']:.2f}; after: largest {clip['largest_norm_after']:.3f}); "
        f"test accuracy {100 * accuracy:.1f}% (bar >= {100 * args.bar:.0f}%): "
        f"{'PASS' if passed else 'FAIL'}"
    )
    return record


if __name__ == "__main__":
    main()
