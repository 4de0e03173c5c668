"""The embedded LocalCluster used when ``fit`` gets no client."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from distributed import Client, LocalCluster


@contextlib.contextmanager
def client_or_local_cluster(
    client: Client | None, *, n_workers: int | None = None, announce: bool = True
) -> Iterator[Client]:
    """``client`` as is, or a LocalCluster (one single-threaded process per core) for the block."""
    if client is not None:
        yield client
        return
    n = n_workers or os.cpu_count() or 1
    with (
        LocalCluster(
            n_workers=n,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as local,
    ):
        if announce:
            print(
                f"dataflow: LocalCluster with {n} worker process(es); "
                f"dashboard {local.dashboard_link}"
            )
        yield local
