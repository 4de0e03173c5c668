"""Synchronous against local and asynchronous updates with one replica throttled: time to a target
score and final score on held-out data.

Every side trains ``--dataset`` (digits by default: sklearn's real 8x8 handwritten digits
and ``DigitsNet``; or signals, gratings, cosmo, the datasets and models of
bench_adaptive_heldout.py) on ``--replicas`` (2) of a LocalCluster (1 thread each),
replica 1 throttled ``--factor`` times (the engine makes it sleep ``(factor - 1) x``
its compute each step), ``--optimizer`` (SGD with momentum 0.9, or Adam; the LR is
bench_adaptive_heldout's ``LR0`` for the pair, 0.05 for digits with SGD as before),
a fixed global batch, one phase per epoch (so the balancer re-splits), held-out score
after every epoch (accuracy %, or R^2 % for the regressions):

* **sync even**: ``Even()``; the fast replica waits for the slow one at every step;
* **sync balanced**: ``Throughput()``, local batches proportional to measured speed;
* **local balanced**: ``Throughput()`` and ``sync.Local(period_seconds=--period)``:
  local steps for a period, then a sample-weighted average of weights and momentum;
* **local + DiLoCo outer**: the same, then an outer Nesterov step on the averaged
  pseudo-gradient (``outer_lr=0.7, outer_momentum=0.9``);
* **async even** / **async balanced**: ``sync.Async(staleness=--staleness)``, a parameter
  store on replica 0's worker, with ``Even()`` or ``Throughput()`` splits; **async even +
  leases**: ``leases=True``, the fast replica takes over the slow one's parts; **+
  overlap**: ``overlap=True``, each push overlaps the next step's compute; **, no
  lookahead**: ``lookahead=False``, replicas compute on the store's weights as they
  are, not extrapolated along the momentum (DANA, the default);
* **local even**: ``Even()`` and ``Local(period_seconds=--period)``, whose sample leases
  let the fast replica take over the slow one's parts (no balancer needed);
* **local even by drift**: ``Local(period_samples=4 x --period-samples, max_drift=1e-3)``:
  the period halves while the replicas drift apart more than 1e-3 at an average;
* **local even by samples**: ``Even()`` and ``Local(period_samples=--period-samples)``:
  the same averages on any machine, so a quiet and a loaded run of one seed end alike
  (``windows`` in the JSON: the averages made).
(``local balanced`` uses leases too: ``period_seconds`` turns them on.)

Time to target: the driver's clock when the first epoch whose held-out accuracy
reaches ``--target`` ended (the fit's start-up excluded: measured from the first step's
arrival). ``--seeds`` seeds each (model init and shuffle), sides interleaved per seed.
Results are appended to ``benchmarks/results/sync.json``.

``--load K`` starts K busy-looping processes for the whole run (a loaded machine: the
workers and the driver share the cores with them). ``--link-mbit R`` runs the replicas'
workers as emulated nodes (``dataflow.tools.emulated_nodes``: network namespaces on
veth links capped at R Mbit/s each way; root only), so every allreduce, push and
average crosses a link of that rate.

    python benchmarks/bench_sync.py              # 3 seeds x 4 sides, ~2 min on 2 cores
    python benchmarks/bench_sync.py --replicas 4 # oversubscribed on 2 cores
    python benchmarks/bench_sync.py --factor 1 --sides "sync balanced,async balanced"
    python benchmarks/bench_sync.py --factor 3 --moving 3   # a straggler that comes and goes
    python benchmarks/bench_sync.py --dataset signals --optimizer adam --seeds 5 \
        --sides "sync balanced,async balanced,local even by samples" --factor 3 --moving 3
    python benchmarks/bench_sync.py --link-mbit 100 --sides "sync balanced,local even"
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from bench_adaptive_heldout import DATASETS, LR0, OPTIMIZERS, Dataset, prepare, score
from records import save_run, table
from workloads import Optimizer

NAME = "sync"


def sides(
    period: float, staleness: int = 2, period_samples: int = 512
) -> dict[str, dict[str, Any]]:
    import dataflow as dfl

    return {
        "local even by samples": dict(
            balancer=dfl.balance.Even(), sync=dfl.sync.Local(period_samples=period_samples)
        ),
        "local even by drift": dict(  # up to 4x the period, halved while drift > 1e-3
            balancer=dfl.balance.Even(),
            sync=dfl.sync.Local(period_samples=4 * period_samples, max_drift=1e-3),
        ),
        "sync even": dict(balancer=dfl.balance.Even()),
        "sync balanced": dict(balancer=dfl.balance.Throughput()),
        "local balanced": dict(
            balancer=dfl.balance.Throughput(), sync=dfl.sync.Local(period_seconds=period)
        ),
        "local + DiLoCo outer": dict(
            balancer=dfl.balance.Throughput(),
            sync=dfl.sync.Local(period_seconds=period, outer_lr=0.7, outer_momentum=0.9),
        ),
        "async even": dict(balancer=dfl.balance.Even(), sync=dfl.sync.Async(staleness=staleness)),
        "async even + leases": dict(
            balancer=dfl.balance.Even(), sync=dfl.sync.Async(staleness=staleness, leases=True)
        ),
        "local even": dict(balancer=dfl.balance.Even(), sync=dfl.sync.Local(period_seconds=period)),
        "async balanced": dict(
            balancer=dfl.balance.Throughput(), sync=dfl.sync.Async(staleness=staleness)
        ),
        "async balanced + overlap": dict(
            balancer=dfl.balance.Throughput(),
            sync=dfl.sync.Async(staleness=staleness, overlap=True),
        ),
        "async even + leases, no lookahead": dict(
            balancer=dfl.balance.Even(),
            sync=dfl.sync.Async(staleness=staleness, leases=True, lookahead=False),
        ),
        "async even + leases + overlap": dict(
            balancer=dfl.balance.Even(),
            sync=dfl.sync.Async(staleness=staleness, leases=True, overlap=True),
        ),
    }


def slowdown(args: argparse.Namespace) -> Any:
    """Replica 1's slow-down: ``--factor`` throughout, or with ``--moving S`` a straggler
    that comes and goes (1x and ``--factor`` by turns, S seconds each)."""
    import dataflow as dfl

    if args.moving is None:
        return args.factor
    return dfl.SlowdownSchedule.alternating(1.0, args.factor, every_s=args.moving)


def learning_rate(dataset: str, optimizer: str) -> float:
    """bench_adaptive_heldout's base LR for the pair; 0.05 for digits with SGD (this
    benchmark's figures before it took other datasets)."""
    if (dataset, optimizer) == ("digits", "sgd"):
        return 0.05
    return LR0[(dataset, optimizer)]


def one_fit(args: argparse.Namespace, client: Any, data: Dataset, seed: int, options: dict) -> dict:
    import dataflow as dfl

    pipe = dfl.Pipeline(
        model=data.model,
        loss=data.loss,
        optimizer=Optimizer(args.optimizer, learning_rate(args.dataset, args.optimizer)),
        source=data.train,
        eval_source=data.test,
        metrics=data.metrics,
        schedule=dfl.schedule.Fixed(args.batch, epochs_per_phase=1),
        throttle={1: slowdown(args)},
        replicas=args.replicas,
        device="cpu",
        seed=seed,
        progress=False,
        **options,
    )
    started = time.perf_counter()
    result = pipe.fit(epochs=args.epochs, client=client)
    wall = time.perf_counter() - started
    steps, epochs = result.history.steps, result.history.epochs
    origin = steps[0].time - steps[0].seconds  # the first step's start, on the driver
    ends = {e: max(s.time for s in steps if s.epoch == e) - origin for e in range(args.epochs)}
    scores = [score(data, e) / 100 for e in epochs]  # accuracy, or R^2, as a fraction
    reached = next((i for i, a in enumerate(scores) if a >= args.target), None)
    return {
        "seed": seed,
        "final_accuracy": scores[-1],
        "accuracy_per_epoch": scores,
        "epoch_end_s": [ends[e] for e in range(args.epochs)],
        "time_to_target_s": None if reached is None else ends[reached],
        "train_s": ends[args.epochs - 1],
        "fit_call_s": wall,
        "splits": [p["local_batches"] for p in result.history.phases],
        "windows": sum(p["windows"] for p in result.history.phases),
    }


def summary(runs: dict[str, list[dict]], target: float) -> list[list[str]]:
    rows = []
    base = statistics.mean(r["train_s"] for r in runs["sync balanced"])
    for side, fits in runs.items():
        acc = [100 * r["final_accuracy"] for r in fits]
        times = [r["time_to_target_s"] for r in fits]
        hit = [t for t in times if t is not None]
        rows.append(
            [
                side,
                f"{statistics.mean(acc):.2f} ({min(acc):.1f}-{max(acc):.1f})",
                f"{statistics.mean(hit):.2f} ({len(hit)}/{len(fits)})" if hit else "never",
                f"{statistics.mean(r['train_s'] for r in fits):.2f}",
                f"{statistics.mean(r['train_s'] for r in fits) / base:.2f}",
            ]
        )
    header = [
        "side",
        "final score % (range)",
        f"s to {100 * target:.0f} % (seeds)",
        "train s",
        "vs sync balanced",
    ]
    return [header, *rows]


@contextlib.contextmanager
def cluster(args: argparse.Namespace) -> Iterator[Any]:
    """A client of ``--replicas`` single-threaded workers: a LocalCluster, or emulated
    nodes on ``--link-mbit`` links."""
    from distributed import Client, LocalCluster

    if args.link_mbit is not None:
        from dataflow.tools.emulated_nodes import EmulatedNodes

        with (
            EmulatedNodes(args.replicas, rate_mbit=args.link_mbit) as nodes,
            Client(nodes.address) as client,
        ):
            yield client
        return
    with (
        LocalCluster(
            n_workers=args.replicas,
            threads_per_worker=1,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as local,
        Client(local) as client,
    ):
        yield client


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that spin for the block's duration: a loaded machine."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds per side (3)")
    p.add_argument("--dataset", default="digits", choices=DATASETS, help="(digits)")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS, help="(sgd)")
    p.add_argument("--replicas", type=int, default=2, help="replicas, one worker each (2)")
    p.add_argument("--epochs", type=int, default=10, help="epochs (10)")
    p.add_argument("--batch", type=int, default=64, help="global batch (64)")
    p.add_argument("--factor", type=float, default=2.0, help="slow-down of replica 1 (2.0)")
    p.add_argument(
        "--moving",
        type=float,
        default=None,
        help="a moving straggler: replica 1 at 1x and --factor by turns, this many s each",
    )
    p.add_argument("--period", type=float, default=0.25, help="Local period_seconds (0.25)")
    p.add_argument("--staleness", type=int, default=2, help="Async staleness bound (2)")
    p.add_argument(
        "--period-samples", type=int, default=512, help="Local period_samples (512: 8 batches)"
    )
    p.add_argument(
        "--sides",
        default="sync even,sync balanced,local even,local balanced,async even,async balanced",
        help="comma-separated sides to run (default: all but DiLoCo)",
    )
    p.add_argument(
        "--target", type=float, default=0.95, help="held-out score target, a fraction (0.95)"
    )
    p.add_argument("--load", type=int, default=0, help="busy processes beside the fits (0)")
    p.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="workers as emulated nodes on links of this many Mbit/s (root; default: loopback)",
    )
    p.add_argument("--out", default=None, help="JSON path (default results/sync.json)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier runs in --out")
    args = p.parse_args()

    data = prepare(args.dataset, quick=False)
    chosen = [side.strip() for side in args.sides.split(",")]
    known = sides(args.period, args.staleness, args.period_samples)
    unknown = [side for side in chosen if side not in known]
    if unknown or "sync balanced" not in chosen:
        p.error(f"--sides: {unknown or 'sync balanced (the baseline)'}; known: {list(known)}")
    runs: dict[str, list[dict]] = {side: [] for side in chosen}
    with cluster(args) as client, busy_processes(args.load):
        for seed in range(args.seeds):
            for side in chosen:
                options = sides(args.period, args.staleness, args.period_samples)[side]
                fit = one_fit(args, client, data, seed, options)
                runs[side].append(fit)
                print(
                    f"seed {seed} {side:15s} final score {100 * fit['final_accuracy']:.2f} % "
                    f"target at {fit['time_to_target_s']} s, trained {fit['train_s']:.2f} s"
                )
    rows = summary(runs, args.target)
    print(table(rows[1:], rows[0]))
    print(
        "saved",
        save_run(NAME, {"args": vars(args), "runs": runs}, args.out, overwrite=args.overwrite),
    )


if __name__ == "__main__":
    main()
