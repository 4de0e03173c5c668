"""What a failure costs: a worker killed mid-window, every replica killed at once, and
checkpoints inside a phase, against a failure-free fit of the same work in the same run.

A new LocalCluster for each fit, warmed up by a one-epoch fit first, with nannies
(which restart a killed worker, as a batch system's replacement would), ``--workers``
single-threaded workers; a small CNN on synthetic images, one phase (``Fixed``),
default ``window_seconds`` (1 s). Each round runs, in rotated order:

* **baseline**: the fit, no failure, no checkpoint;
* **checkpointed**: the same with ``checkpoint_every=--every`` windows (mid-phase
  checkpoints to a temporary folder): the ratio of training time to the baseline is
  the checkpoints' cost;
* **one worker killed**: a stage SIGKILLs replica 1's worker process at step
  ``--kill-step`` (inside a window). Reported: seconds from the kill to the driver
  noticing (``detected``) and to training resuming on the survivors (``resumed``),
  the steps replayed (the window in progress), and the fit's extra time over the
  baseline;
* **every replica killed**: every replica's worker at the same step, with
  mid-phase checkpoints: no survivor holds the commit, so the fit waits for the
  nannies' restarts and starts again from the newest checkpoint. Reported: seconds
  from the kill to training resuming, and the steps redone.

``--sync async`` runs every fit under ``dfl.sync.Async(staleness=1)``: a lost replica
that hosts no store shard costs only its gradient in flight (the others finish the
window without it and retrain the parts the store never applied), where synchronous
training replays the window on every survivor. ``parts redone`` counts the work
trained again: (replica, step) parts.

    python benchmarks/bench_recovery.py            # ~3-5 minutes on 2 cores
    python benchmarks/bench_recovery.py --sync async --kinds "baseline,one worker killed"
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure
import records
import workloads

import dataflow as dfl
from dataflow import stages


class KillAt(stages.Stage):
    """SIGKILLs its own worker at step ``step`` on replica ``rank`` (None: every
    replica), once: the marker ``<marker>.<rank>`` holds the time of the kill."""

    def __init__(self, marker: str, *, step: int, rank: int | None) -> None:
        super().__init__("KillAt")
        self.marker, self.step, self.rank = marker, step, rank

    def run(self, step: stages.StepContext, batch: stages.Batch) -> stages.Batch:
        rank = step.replica.rank
        marker = Path(f"{self.marker}.{rank}")
        if (
            step.spec.index == self.step
            and self.rank in (rank, None)
            and step.replica.world_size > 1
            and not marker.exists()
        ):
            marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def build(args: argparse.Namespace, kill: KillAt | None) -> dfl.Trainer:
    config = workloads.CNNConfig()
    x, y = workloads.make_data(args.samples, config)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    if kill is not None:
        batch = g.add(kill, batch)
    out = g.add(
        stages.Forward(workloads.ModelFactory(config), torch.nn.functional.cross_entropy), batch
    )
    reduced = g.add(stages.AllReduce(), g.add(stages.Backward(), out))
    g.add(stages.Update(workloads.OptimizerFactory(workloads.OptimConfig())), reduced)
    schedule = dfl.schedule.Fixed(args.batch, epochs_per_phase=args.epochs)
    sync = dfl.sync.Async(staleness=1) if args.sync == "async" else dfl.sync.Synchronous()
    return dfl.Trainer(g, schedule=schedule, seed=0, progress=False, min_workers=1, sync=sync)


def kill_time(marker: str) -> float:
    times = [float(p.read_text()) for p in Path(marker).parent.glob(Path(marker).name + ".*")]
    return min(times)


def one_fit(args: argparse.Namespace, kind: str, folder: Path) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        build(args, None).fit(1, client=client)  # warm the workers (imports, first steps)
        return measured_fit(args, client, kind, folder)


def measured_fit(args: argparse.Namespace, client: Any, kind: str, folder: Path) -> dict[str, Any]:
    marker = str(folder / f"killed-{kind}-{time.monotonic_ns()}")
    kill = None
    if kind == "one worker killed":
        kill = KillAt(marker, step=args.kill_step, rank=1)
    elif kind == "every replica killed":
        kill = KillAt(marker, step=args.kill_step, rank=None)
    options: dict[str, Any] = {}
    if kind in ("checkpointed", "every replica killed"):
        options = dict(checkpoint_dir=folder / f"ckpt-{time.monotonic_ns()}")
        options["checkpoint_every"] = args.every
    result = build(args, kill).fit(args.epochs, client=client, **options)
    info = result.history.info
    phase = result.history.phases[-1]
    row: dict[str, Any] = {
        "kind": kind,
        "train_seconds": info["train_seconds"],
        "steps": len(result.history.steps),
        "windows": phase["windows"],
        "final_loss": result.history.epochs[-1]["train_loss"],
        "ledger_exact": all(
            len(result.ledger.consumed(e)) == args.samples for e in range(args.epochs)
        ),
    }
    writes = [c["seconds"] for c in info.get("checkpoints", []) if c["mid_phase"]]
    if writes:
        row.update(checkpoint_writes=len(writes), checkpoint_write_s=measure.median(writes))
    failures = info.get("failures", [])
    if kill is not None:
        killed = kill_time(marker)
        done = [f for f in failures if "resumed_at" in f]
        row.update(
            failures=len(failures),
            detected_s=min(f["detected_at"] for f in failures) - killed,
            resumed_s=max(f["resumed_at"] for f in done) - killed,
            steps_redone=sum(f["window_steps_lost"] for f in done),
            # a rollback replays the window on every replica; a kept window (async)
            # retrains only the parts the store never applied
            parts_redone=sum(
                f.get("retrained_parts", f["window_steps_lost"] * f["replicas_before"])
                for f in done
            ),
        )
        restarts = [f for f in failures if "restarted_from_step" in f]
        if restarts:
            row["restarted_from_step"] = restarts[0]["restarted_from_step"]
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--samples", type=int, default=3072)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=50, help="a step inside the phase")
    p.add_argument("--every", type=int, default=4, help="windows between checkpoints")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sync", choices=("sync", "async"), default="sync")
    p.add_argument(
        "--kinds", default=",".join(KINDS), help="comma-separated, from: " + ", ".join(KINDS)
    )
    p.add_argument("--out", default=None, help="JSON file (default results/recovery.json)")
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


KINDS = ("baseline", "checkpointed", "one worker killed", "every replica killed")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(","))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or "baseline" not in kinds:
        raise SystemExit(f"--kinds: {unknown or 'baseline missing'}; choose from {KINDS}")
    # `workloads` is imported on the workers by name (their sys.path is this process's, with
    # benchmarks/ in it); KillAt, defined in __main__, travels by value.
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            shift = round_index % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                row = one_fit(args, kind, Path(tmp))
                row["round"] = round_index
                rows.append(row)
                print(f"round {round_index}: {kind}: {row['train_seconds']:.1f} s", flush=True)
    summary = summarize(rows, kinds)
    print(report(summary))
    path = records.save_run(
        "recovery",
        {"args": vars(args), "rows": rows, "summary": summary},
        args.out,
        overwrite=args.overwrite,
    )
    print(f"saved {path}")
    return summary


def summarize(rows: list[dict[str, Any]], kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    def of(kind: str, key: str) -> list[float]:
        return [r[key] for r in rows if r["kind"] == kind and key in r]

    base = measure.median(of("baseline", "train_seconds"))
    out: dict[str, Any] = {"baseline_train_s": base, "kinds": [k for k in kinds if k != "baseline"]}
    for kind in out["kinds"]:
        seconds = measure.median(of(kind, "train_seconds"))
        out[kind] = {
            "train_s": seconds,
            "extra_s": seconds - base,
            "ratio_to_baseline": seconds / base,
            "ledger_exact": all(of(kind, "ledger_exact")),
        }
        for key in (
            "detected_s",
            "resumed_s",
            "steps_redone",
            "parts_redone",
            "checkpoint_write_s",
        ):
            values = of(kind, key)
            if values:
                out[kind][key] = {"median": measure.median(values), "max": max(values)}
    windows = of("baseline", "windows")
    steps = of("baseline", "steps")
    out["steps_per_window"] = measure.median([s / w for s, w in zip(steps, windows, strict=True)])
    return out


def report(summary: dict[str, Any]) -> str:
    rows = []
    for kind in summary["kinds"]:
        s = summary[kind]
        rows.append(
            [
                kind,
                f"{s['train_s']:.1f}",
                f"{s['ratio_to_baseline']:.2f}",
                f"{s['detected_s']['median']:.2f}" if "detected_s" in s else "",
                f"{s['resumed_s']['median']:.2f} (max {s['resumed_s']['max']:.2f})"
                if "resumed_s" in s
                else "",
                f"{s['steps_redone']['max']:.0f}" if "steps_redone" in s else "",
                f"{s['parts_redone']['max']:.0f}" if "parts_redone" in s else "",
                f"{s['checkpoint_write_s']['median'] * 1000:.0f} ms"
                if "checkpoint_write_s" in s
                else "",
                "yes" if s["ledger_exact"] else "NO",
            ]
        )
    head = (
        f"baseline (no failure, no checkpoint): {summary['baseline_train_s']:.1f} s of "
        f"training; {summary['steps_per_window']:.0f} steps per window"
    )
    return (
        head
        + "\n"
        + records.table(
            rows,
            [
                "run",
                "train s",
                "x baseline",
                "kill->detected s",
                "kill->resumed s",
                "steps redone (max)",
                "parts redone (max)",
                "ckpt write",
                "ledger exact",
            ],
        )
    )


if __name__ == "__main__":
    main()
