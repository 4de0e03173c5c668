"""Round trips between two worker processes: the parameter store's data plane
(``dataflow.ps.plane``) against Dask's worker-to-worker RPC (the store's path before
it) and torch.distributed over gloo (point-to-point send/recv, and an allreduce of
the same bytes), for 4 KB, 1 MB and 25 MB of float32.

Each side runs ``--repeats`` round trips after ``--warmup`` and reports the median in
milliseconds (and MB/s for the largest payload; a round trip moves the payload twice):

* **store plane**: from a task on worker A, a ``PlaneConnection`` to a ``PlaneServer``
  on worker B whose handler (on B's store loop) sends the tensor back: the path of a
  push and its reply, without the shard's own work;
* **dask rpc**: from a task on worker A, ``worker.rpc(B).dataflow_echo(payload=...)``,
  B's handler sending the tensor back (how the store pushed a gradient and pulled the
  weights before its data plane: one RPC each way);
* **gloo send/recv**: rank 0 sends, rank 1 receives and sends back;
* **gloo allreduce**: one allreduce of the payload on the same two ranks (what a
  synchronous step moves), for scale.

    python benchmarks/bench_data_plane.py            # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from records import machine_info, save_run, table

NAME = "data_plane"
SIZES = {"4 KB": 1 << 10, "1 MB": 1 << 18, "25 MB": 25 * (1 << 18)}  # float32 elements


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Dask RPC ------------------------------------------------------------------------------


def install_echo(dask_worker: Any) -> None:
    async def echo(payload: Any = None) -> Any:
        from distributed.protocol import to_serialize

        return {"payload": to_serialize(payload)}

    dask_worker.handlers["dataflow_echo"] = echo


def rpc_round_trips(peer: str, elements: int, repeats: int, warmup: int) -> list[float]:
    """Runs in a task on worker A: ``repeats`` echo round trips through worker ``peer``."""
    from distributed import get_worker
    from distributed.protocol import to_serialize
    from distributed.utils import sync

    worker = get_worker()
    tensor = torch.ones(elements)

    async def once() -> None:
        reply = await worker.rpc(peer).dataflow_echo(payload=to_serialize(tensor))
        assert reply["payload"].numel() == elements

    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        sync(worker.loop, once)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


async def _echo(**message: Any) -> dict[str, Any]:
    return {"status": "ok", "payload": message["payload"]}


def start_plane(dask_worker: Any) -> dict[str, str]:
    """On worker B: a store loop and a plane server echoing each request."""
    from distributed.comm import get_address_host

    from dataflow.ps.plane import PlaneServer, StoreLoop

    server = PlaneServer(get_address_host(dask_worker.address), _echo, StoreLoop())
    dask_worker._bench_plane = server  # kept alive for the benchmark's length
    return {"address": server.address, "token": server.token}


def plane_round_trips(
    where: dict[str, str], elements: int, repeats: int, warmup: int
) -> list[float]:
    """Runs in a task on worker A: ``repeats`` echo round trips over the data plane."""
    from dataflow.ps.plane import PlaneConnection

    connection = PlaneConnection(where["address"], where["token"], timeout_s=60)
    tensor = torch.ones(elements)
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        connection.send({"payload": tensor})
        reply = connection.receive()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        assert reply["payload"].numel() == elements
    connection.close()
    return times


def dask_side(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from distributed import Client

    from dataflow.runtime.cluster import start_local_cluster
    from dataflow.runtime.malloc import relax_malloc

    out: dict[str, dict[str, float]] = {"store plane": {}, "dask rpc": {}}
    with (
        start_local_cluster(2) as cluster,
        Client(cluster) as client,
    ):
        # as in a fit: the replica workers serve tensor-sized buffers from glibc's heap
        # (dataflow.runtime.malloc), not from fresh zeroed pages per message
        client.run(relax_malloc)
        client.run(install_echo)
        a, b = sorted(client.scheduler_info()["workers"])
        where = client.run(start_plane, workers=[b])[b]
        for label, elements in SIZES.items():
            future = client.submit(
                plane_round_trips,
                where,
                elements,
                args.repeats,
                args.warmup,
                workers=[a],
                pure=False,
            )
            out["store plane"][label] = statistics.median(future.result()) * 1e3
            future = client.submit(
                rpc_round_trips, b, elements, args.repeats, args.warmup, workers=[a], pure=False
            )
            out["dask rpc"][label] = statistics.median(future.result()) * 1e3
    return out


# -- gloo ------------------------------------------------------------------------------


def gloo_rank(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out: dict[str, dict[str, float]] = {"send/recv": {}, "allreduce": {}}
    for label, elements in SIZES.items():
        tensor = torch.ones(elements)
        p2p, reduce = [], []
        for i in range(args.warmup + args.repeats):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            else:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)
            middle = time.perf_counter()
            dist.barrier()
            again = time.perf_counter()
            dist.all_reduce(tensor)
            end = time.perf_counter()
            if i >= args.warmup:
                p2p.append(middle - start)
                reduce.append(end - again)
        out["send/recv"][label] = statistics.median(p2p) * 1e3
        out["allreduce"][label] = statistics.median(reduce) * 1e3
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def gloo_side(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(gloo_rank, args=(free_port(), args, results), nprocs=2, join=True)
        return dict(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=50, help="timed round trips per size (50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed round trips first (5)")
    p.add_argument("--out", default=None, help="JSON path (default results/data_plane.json)")
    p.add_argument("--overwrite", action="store_true", help="replace earlier runs in --out")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sides = {**dask_side(args), **gloo_side(args)}
    rows = []
    for side, by_size in sides.items():
        big = by_size["25 MB"]
        rate = 2 * 25 * (1 << 20) / (big / 1e3) / 1e6  # the payload moves there and back
        rows.append([side, *(f"{by_size[s]:.3f}" for s in SIZES), f"{rate:.0f}"])
    print(table(rows, ["side", *(f"{s} ms" for s in SIZES), "25 MB round trip, MB/s"]))
    rpc, plane = sides["dask rpc"], sides["store plane"]
    p2p, reduce = sides["send/recv"], sides["allreduce"]
    for size in SIZES:
        print(
            f"{size}: store plane {plane[size]:.3f} ms, {rpc[size] / plane[size]:.1f}x the speed "
            f"of dask rpc, {p2p[size] / plane[size]:.2f}x gloo send/recv, "
            f"{reduce[size] / plane[size]:.2f}x a gloo allreduce"
        )
    run = {"machine": machine_info(), "args": vars(args), "median_ms": sides}
    print("saved", save_run(NAME, run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
