"""Per-worker state: the replicas (and rendezvous stores) of the fits in progress.

Lives in a ``distributed.WorkerPlugin`` rather than module globals, so state is
tied to the worker's lifetime, torn down with it, and several fits can share a
worker process without stepping on each other.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from distributed import WorkerPlugin, get_worker

from dataflow.ps.service import HANDLER, ShardRegistry
from dataflow.runtime.cluster import QuietEngineFailures
from dataflow.runtime.gpu_claim import ClaimOnce

PLUGIN_NAME = "dataflow"
_INSTALLING = threading.Lock()  # guards installing the plugin only; its state is per worker


class DataflowWorkerPlugin(WorkerPlugin):
    name = PLUGIN_NAME

    def setup(self, worker: Any) -> None:
        self.worker = worker
        # A replica's error is raised by the fit on the driver, with this worker's
        # traceback: not logged here too as "Compute Failed" (nor the windows a stop or a
        # recovery aborts), on any cluster, not only the embedded one
        logger = logging.getLogger("distributed.worker")
        if not any(isinstance(f, QuietEngineFailures) for f in logger.filters):
            logger.addFilter(QuietEngineFailures())
        self.replicas: dict[str, Any] = {}  # run id -> ReplicaRuntime
        self.stores: dict[str, Any] = {}  # run id -> rank 0's TCPStore until the group forms
        # Process groups (by group key) the driver gave up forming: a rank waiting for
        # its peers to arrive stops waiting
        self.aborted_groups: set[str] = set()
        # Group key -> the Collective of a group joined but not yet set up (its stages'
        # first collectives, a broadcast of the weights): a member lost then leaves the
        # others waiting there, so giving the group up aborts it too
        self.forming_groups: dict[str, Any] = {}
        self.profiler_paused_by: set[str] = set()  # runs that asked for the profiler off
        # Aborted process groups of finished fits: destroying one whose operation still
        # waits on a dead peer would freeze this worker until the timeout.
        self.retired_groups: list[Any] = []
        # Parameter-store shards this worker hosts (sync.Async): replicas push over the
        # registry's data plane; Dask's RPC handler carries control (fail)
        self.ps = ShardRegistry()
        worker.handlers[HANDLER] = self.ps.handle_rpc
        # The GPU this worker trains on when it sees several: taken on first use, held
        # for the worker's life (runtime/gpu_claim.py)
        self.gpu = ClaimOnce()

    def teardown(self, worker: Any) -> None:
        for run_id in list(self.replicas):
            self.close_run(run_id)
        self.ps.close()
        self.gpu.release()

    def replica(self, run_id: str) -> Any:
        try:
            return self.replicas[run_id]
        except KeyError:
            raise KeyError(
                f"worker {self.worker.address} holds no replica of fit {run_id!r} (it holds "
                f"{sorted(self.replicas) or 'none'}); the worker may have restarted since the "
                "fit began"
            ) from None

    def abort_run(self, run_id: str) -> None:
        runtime = self.replicas.get(run_id)
        if runtime is not None:
            runtime.abort()

    def pause_profiler(self, run_id: str) -> None:
        """Stop Dask's statistical profiler while ``run_id`` trains here.

        Every 10 ms it takes the GIL to walk the task thread's stack, which the
        training step then waits for; the dashboard's Profile page stays empty meanwhile.
        """
        self.profiler_paused_by.add(run_id)
        self._set_profiler(running=False)

    def _set_profiler(self, *, running: bool) -> None:
        for name in ("profile", "profile-cycle"):
            callback = self.worker.periodic_callbacks.get(name)
            if callback is not None:  # tornado callbacks: change them on the event loop
                self.worker.loop.add_callback(callback.start if running else callback.stop)

    def close_run(self, run_id: str) -> None:
        if run_id in self.profiler_paused_by:
            self.profiler_paused_by.discard(run_id)
            if not self.profiler_paused_by:
                self._set_profiler(running=True)
        self.stores.pop(run_id, None)
        self.aborted_groups = {
            k for k in self.aborted_groups if k != run_id and not k.startswith(f"{run_id}/")
        }
        for key in [k for k in self.forming_groups if k.startswith(f"{run_id}/")]:
            self.retired_groups.append(self.forming_groups.pop(key))
        runtime = self.replicas.pop(run_id, None)
        if runtime is not None:
            runtime.close()
            self.retired_groups.extend(runtime.retired)
            spatial = runtime.context.spatial
            for collective in (
                runtime.context.collective,
                None if spatial is None else spatial.collective,
            ):
                if collective is not None and collective.closed:
                    self.retired_groups.append(collective)


def current_plugin() -> DataflowWorkerPlugin:
    """The plugin of the worker running the calling task, installed on first use.

    Installed here rather than with ``client.register_plugin``: re-registering on a
    cluster tears down the instance that holds other fits' replicas, and a worker a
    nanny restarted mid-fit gets it without a round trip to the driver.
    """
    return plugin_of(get_worker())


def running_plugin() -> DataflowWorkerPlugin | None:
    """:func:`current_plugin` inside a Dask worker; ``None`` elsewhere (the driver)."""
    try:
        worker = get_worker()
    except ValueError:
        return None
    return plugin_of(worker)


def plugin_of(worker: Any) -> DataflowWorkerPlugin:
    """``worker``'s plugin, installed if this is its first use: a message of the driver
    (a group's forming given up) can reach a freshly restarted worker before any task
    of the fit did, and must not be dropped there."""
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is not None:
        return plugin
    with _INSTALLING:  # the task thread and the event loop may both be first
        plugin = worker.plugins.get(PLUGIN_NAME)
        if plugin is None:
            plugin = DataflowWorkerPlugin()
            plugin.setup(worker)
            worker.plugins[PLUGIN_NAME] = plugin
    return plugin
