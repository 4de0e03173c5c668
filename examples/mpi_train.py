"""Train a small CNN on a Dask cluster that dask-mpi starts inside an MPI job.

Every MPI rank runs this same script. dask_mpi.initialize() turns rank 0 into the
Dask scheduler and ranks 2, 3, ... into one single-threaded Dask worker each (one
replica per worker: one per GPU on a GPU machine); rank 1 returns from it and runs
the training below as the client. When the client's script ends, dask-mpi shuts
the scheduler and the workers down, so the MPI job ends with it.

  mpirun -np 4 python examples/mpi_train.py               # 2 workers on this machine
  srun -n 6 --gpus-per-task=1 python examples/mpi_train.py --epochs 20   # 4 GPU workers
  mpirun -np 6 python examples/mpi_train.py --gpus-per-node 4   # one node with 4 GPUs
  mpirun -np 4 python examples/mpi_train.py --checkpoint-dir runs/mpi-ckpt   # resumable

With --checkpoint-dir the fit resumes from the newest checkpoint there, and a SIGUSR1
to the job (SLURM's --signal=USR1@120 before the time limit; mpirun forwards it to
every rank) saves the fit's last commit and ends the job; run the same command again
to go on. The scheduler and worker ranks ignore that signal: only the client acts on it.

See docs/hpc.md for SLURM batch scripts, dask-jobqueue and troubleshooting.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

SCHEDULER_RANK, CLIENT_RANK = 0, 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048, help="training samples (default 2048)")
    parser.add_argument("--size", type=int, default=32, help="field size in pixels (default 32)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="auto", help="'auto' (CUDA when the worker has a GPU), 'cpu', 'cuda'"
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="give each worker rank one GPU of its node (sets CUDA_VISIBLE_DEVICES per rank); "
        "not needed under srun --gpus-per-task=1, which does it already",
    )
    parser.add_argument(
        "--interface", default=None, help="network interface for Dask, e.g. ib0 (default: any)"
    )
    parser.add_argument(
        "--local-directory",
        default=None,
        help="worker scratch space; node-local disk such as $TMPDIR (default: the temp dir)",
    )
    parser.add_argument(
        "--dashboard-address", default=":8787", help="scheduler dashboard (':0' for any port)"
    )
    parser.add_argument(
        "--wait-workers-s",
        type=float,
        default=120.0,
        help="how long the client waits for all worker ranks to join (default 120)",
    )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=300.0,
        help="how long a replica waits in an allreduce before failing (default 300)",
    )
    parser.add_argument(
        "--log-level", default="warning", help="Dask's log level on every rank (default warning)"
    )
    parser.add_argument("--out", default="runs/mpi", help="folder for history.json and run.json")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoint there (every 100 windows and at phase ends) and resume from it",
    )
    return parser.parse_args(argv)


def pin_gpu(comm, gpus_per_node: int) -> None:
    """Give this worker rank its own GPU: the i-th worker rank on a node gets GPU i.

    Must run before CUDA is initialized in this process (torch only reads
    CUDA_VISIBLE_DEVICES then). Ranks 0 and 1 (scheduler, client) get none.
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    is_worker = comm.Get_rank() not in (SCHEDULER_RANK, CLIENT_RANK)
    flags = node.allgather(is_worker)
    index = sum(flags[: node.Get_rank()])  # worker ranks before me on this node
    node.Free()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(gpus_per_node)]
    devices = devices[:gpus_per_node]
    if not is_worker:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif index >= len(devices):
        print(
            f"mpi_train: rank {comm.Get_rank()} is worker {index} on its node, which has "
            f"{len(devices)} GPU(s); start at most --gpus-per-node worker ranks per node "
            "(docs/hpc.md: place ranks 0 and 1 on the first node)",
            file=sys.stderr,
            flush=True,
        )
        comm.Abort(1)  # not sys.exit: the other ranks would wait for this one forever
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[index]


def train(args: argparse.Namespace, world_size: int) -> dict:
    """Rank 1: connect to the dask-mpi cluster and fit; return what happened."""
    # Imported here, after dask_mpi.initialize(): the scheduler rank never needs torch,
    # and the worker ranks import it when their first task arrives.
    import torch
    import torch.nn.functional as F
    from distributed import Client

    import dataflow as dfl
    from dataflow.runtime.cluster import live_workers
    from dataflow.tools.demo import FieldNet, random_fields

    workers_expected = world_size - 2
    out = Path(args.out)
    with Client() as client:  # dask-mpi put the scheduler's address in the Dask config
        client.wait_for_workers(workers_expected, timeout=args.wait_workers_s)
        workers = live_workers(client)
        print(
            f"mpi_train: {len(workers)} worker(s) on MPI ranks "
            f"{sorted(int(w['name']) for w in workers.values())}; "
            f"dashboard {client.dashboard_link}",
            flush=True,
        )
        x, y = random_fields(args.samples, args.size, seed=args.seed)
        pipe = dfl.Pipeline(
            model=FieldNet,
            loss=F.cross_entropy,
            optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
            source=dfl.io.ArraySource(x, y),
            schedule=dfl.schedule.Fixed(batch_size=args.batch),
            seed=args.seed,
            device=args.device,
            collective_timeout_s=args.collective_timeout_s,
            progress=sys.stderr.isatty(),
        )
        started = time.perf_counter()
        saving = dict(checkpoint_dir=args.checkpoint_dir, resume=True, checkpoint_every=100)
        try:
            result = pipe.fit(
                epochs=args.epochs, client=client, **(saving if args.checkpoint_dir else {})
            )
        except dfl.errors.FitStopped as stopped:  # SIGUSR1: the commit is saved
            print(f"mpi_train: {stopped}", flush=True)
            client.retire_workers(close_workers=True)
            raise SystemExit(3) from None
        seconds = time.perf_counter() - started
        print(result.summary(), flush=True)

        replicas = result.history.info["replicas"]
        report = {
            "mpi_world_size": world_size,
            "client_rank": CLIENT_RANK,
            "scheduler": client.scheduler.address,
            "dask_workers": {addr: int(w["name"]) for addr, w in workers.items()},
            "replicas": replicas,
            "replica_workers": [w["worker"] for w in result.history.info["workers"]],
            "devices": [w["device"] for w in result.history.info["workers"]],
            # What each worker rank sees (--gpus-per-node pins one GPU per worker rank).
            "cuda_visible_devices": client.run(os.getenv, "CUDA_VISIBLE_DEVICES"),
            "backend": [w["backend"] for w in result.history.info["workers"]],
            "num_samples": args.samples,
            "epochs": args.epochs,
            "epoch_losses": [e["train_loss"] for e in result.history.epochs],
            "step_losses": result.history.losses,
            "fit_seconds": seconds,
            **sample_accounting(pipe, result, args.epochs),
        }
        # Close the workers before the scheduler (dask-mpi shuts that down when this script
        # ends), so their ranks exit quietly instead of reporting a lost scheduler.
        client.retire_workers(close_workers=True)
    out.mkdir(parents=True, exist_ok=True)
    result.history.to_json(out / "history.json")
    (out / "run.json").write_text(json.dumps(report))
    print(f"mpi_train: wrote {out / 'history.json'} and {out / 'run.json'}", flush=True)
    return report


def sample_accounting(pipe, result, epochs: int) -> dict:
    """Per epoch and replica, the sample indices the plan gave it ("plan": computed on
    this rank, no cluster) and those its worker reported training on ("ledger")."""
    import numpy as np

    replicas = result.history.info["replicas"]
    specs = [spec for plan in pipe.plan(epochs, replicas) for spec in plan.steps]
    planned: dict[int, dict[int, list]] = {}
    for spec, parts in zip(specs, pipe.sample_plan(epochs, replicas), strict=True):
        for rank, part in enumerate(parts):
            planned.setdefault(spec.epoch, {}).setdefault(rank, []).append(part)
    ledger = result.ledger
    return {
        "plan": {
            str(epoch): {str(r): np.sort(np.concatenate(p)).tolist() for r, p in ranks.items()}
            for epoch, ranks in planned.items()
        },
        "ledger": {
            str(epoch): {str(r): ledger.consumed(epoch, r).tolist() for r in ledger.replicas(epoch)}
            for epoch in ledger.epochs
        },
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # before MPI starts, so --help works anywhere
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() < 3:
        raise SystemExit(
            f"mpi_train: {comm.Get_size()} MPI rank(s); dask-mpi needs at least 3 (scheduler, "
            "client, one worker): run it as mpirun -np 4 python examples/mpi_train.py"
        )
    if args.gpus_per_node:
        pin_gpu(comm, args.gpus_per_node)

    import dask_mpi

    logging.getLogger("distributed").setLevel(args.log_level.upper())  # after its import

    # A batch system's notice before it ends the job reaches every rank: the scheduler
    # and the workers must live on while the client's fit saves its commit (the fit sets
    # its own handler on rank 1 while it runs)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # Ranks 0 and 2+ block in here as the scheduler and the workers, and exit when the
    # client (rank 1) is done; rank 1 returns and trains. nthreads=1: one replica per worker.
    dask_mpi.initialize(
        interface=args.interface,
        nthreads=1,
        local_directory=args.local_directory,
        dashboard_address=args.dashboard_address,
    )
    train(args, comm.Get_size())


if __name__ == "__main__":
    main()
