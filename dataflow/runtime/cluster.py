"""The embedded LocalCluster used when ``fit`` gets no client."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from distributed import Client, LocalCluster

from dataflow.errors import ConfigError

MAIN_GUARD_HINT = (
    "the embedded LocalCluster's worker processes failed to start. Worker processes "
    "import your script: if it calls fit() at top level, put that code under "
    '`if __name__ == "__main__":` (or pass client=distributed.Client(...))'
)


def start_local_cluster(n_workers: int) -> LocalCluster:
    """One single-threaded worker process per core, dashboard on a free port."""
    try:
        return LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        )
    except RuntimeError as exc:  # "Nanny failed to start": say the likely cause
        raise ConfigError(MAIN_GUARD_HINT) from exc


@contextlib.contextmanager
def client_or_local_cluster(
    client: Client | None, *, n_workers: int | None = None, announce: bool = True
) -> Iterator[Client]:
    """``client`` as is, or a LocalCluster (one single-threaded process per core) for the block."""
    if client is not None:
        yield client
        return
    n = n_workers or os.cpu_count() or 1
    with start_local_cluster(n) as cluster, Client(cluster) as local:
        if announce:
            print(
                f"dataflow: LocalCluster with {n} worker process(es); "
                f"dashboard {local.dashboard_link}"
            )
        yield local
