"""The embedded cluster's workers import the engine in the background as they start."""

from __future__ import annotations

import sys
import time

import pytest

from dataflow.runtime.cluster import _worker_preloads
from dataflow.runtime.warm_start import MODULES


def _warmed(names, dask_worker):
    """The worker's warm-start thread has run to its end, and the modules are in."""
    thread = dask_worker.dataflow_warm_start
    return not thread.is_alive() and all(name in sys.modules for name in names)


@pytest.mark.slow  # the session's cluster: not started by the fast tier
def test_embedded_workers_import_the_engine_before_any_task_needs_it(client):
    """The session's cluster is the embedded kind (``client_or_local_cluster(None)``):
    its workers' warm-start thread imports torch, its compiler front end and the
    stages without a task asking (the check itself imports nothing)."""
    assert "dataflow.runtime.warm_start" in _worker_preloads()
    deadline = time.monotonic() + 120  # a loaded machine imports slowly; it must finish
    while not all(client.run(_warmed, MODULES).values()):
        assert time.monotonic() < deadline, client.run(lambda: sorted(MODULES))
        time.sleep(0.2)
