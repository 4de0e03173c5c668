"""P local processes joined in a gloo process group: try a partitioned model on a
laptop, test it, benchmark it, without a Dask cluster.

Starting torch in a process takes seconds, so the processes live as long as the pool:
``pool.run(fn, *args, grid=...)`` calls ``fn(group, *args)`` on every rank (``fn``
importable by module name, ``group`` a :class:`~dataflow.spatial.comm.SpatialGroup`
over the P ranks as ``grid``) and returns the P results in rank order.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, size: int, port: int, threads: int, inbox: Any, outbox: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.TCPStore(
        "127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=60))
    from dataflow.spatial.comm import SpatialGroup

    while True:
        job = inbox.get()
        if job is None:
            return
        fn, grid, args = job
        try:
            group = SpatialGroup(pg, rank=rank, size=size, grid=grid)
            outbox.put((rank, True, fn(group, *args)))
        except Exception:
            outbox.put((rank, False, traceback.format_exc()))


class LocalGroup:
    def __init__(self, size: int, threads: int = 1) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.size = size
        self.inboxes = [ctx.Queue() for _ in range(size)]
        self.outbox = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, size, port, threads, self.inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()

    def run(
        self, fn: Any, *args: Any, grid: tuple[int, ...] | None = None, timeout: float = 120
    ) -> list[Any]:
        for box in self.inboxes:
            box.put((fn, grid or (self.size,), args))
        results: dict[int, Any] = {}
        errors = []
        for _ in range(self.size):
            rank, ok, value = self.outbox.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(self.size)]

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
