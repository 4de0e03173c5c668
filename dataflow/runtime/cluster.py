"""The client a fit runs on: the caller's, one connected to an address or cluster, or an
embedded LocalCluster."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import dask.config
from distributed import Client, LocalCluster, WorkerPlugin
from distributed.comm import connect
from distributed.deploy import Cluster
from distributed.utils import LoopRunner, sync

from dataflow.core.errors import ConfigError
from dataflow.runtime.interrupt import close_quickly, say_interrupted, saying_interrupted
from dataflow.runtime.main_guard import SPAWNING_METHODS, unguarded_script_line

WORKER_PRELOAD = "dataflow.runtime.interrupt"  # its dask_setup: workers ignore SIGINT

MAIN_GUARD_HINT = (
    "the embedded LocalCluster's worker processes failed to start. Worker processes "
    "import your script: if it calls fit() at top level, put that code under "
    '`if __name__ == "__main__":` (or pass client=distributed.Client(...))'
)


# The keys of the engine's tasks: ``<stages>@replica<r>-...fit<run id>...``, the rendezvous
ENGINE_TASK = re.compile(r"(@replica\d+-|^rendezvous-)\S*fit[0-9a-f]{12}")


class QuietEngineFailures(logging.Filter):
    """Drops the "Compute Failed" record ``distributed.worker`` logs when one of the
    engine's tasks raises: the fit raises that error on the driver itself, with the
    worker's traceback, so the user reads it once (not also as an escaped log block per
    replica). Other tasks' failures are logged as usual."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Compute Failed") or not record.args:
            return True
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return ENGINE_TASK.search(str(args[0])) is None


class QuietEngineFailuresPlugin(WorkerPlugin):
    """Installs :class:`QuietEngineFailures` on each worker of the embedded cluster (a
    nanny's restarted worker too: the scheduler hands plugins to every new worker)."""

    name = "dataflow-quiet-failures"

    def setup(self, worker: Any) -> None:
        logger = logging.getLogger("distributed.worker")
        if not any(isinstance(f, QuietEngineFailures) for f in logger.filters):
            logger.addFilter(QuietEngineFailures())


def live_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The scheduler's workers now (address -> info), asked of the scheduler directly.

    Not ``client.scheduler_info()``: it returns the client's cached identity, which the
    client's periodic refresh (totals only, ``"workers"`` empty) can overwrite between
    the fetch and the return, so every worker would look gone.
    """
    identity = client.sync(client.scheduler.identity, n_workers=-1)
    return dict(identity.get("workers", {}))


class EmbeddedCluster(LocalCluster):
    """A LocalCluster whose watch of the scheduler outlives a worker removed twice, or
    removed before the cluster heard of it (a SIGKILLed worker can be: dask/distributed
    issue 5407). The stock watch dies on that KeyError and raises it again when the
    cluster closes: after a fit that recovered from the loss, its ``with`` block would
    end in ``KeyError: 'tcp://...'``."""

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op == "remove" and msg not in self.scheduler_info.get("workers", {}):
            return  # nothing of it left to forget
        super()._update_worker_status(op, msg)


def start_local_cluster(n_workers: int) -> LocalCluster:
    """One single-threaded worker process per core, dashboard on a free port. A script
    that calls this from its top level, unguarded, is told so before anything starts."""
    method = dask.config.get("distributed.worker.multiprocessing-method", "spawn")
    where = unguarded_script_line(sys._getframe(1)) if method in SPAWNING_METHODS else None
    if where is not None:
        path, line = where
        raise ConfigError(
            f"{path}, line {line}: this starts an embedded LocalCluster from the script's "
            "top level; its worker processes import the script again, and each would start "
            'a cluster of its own. Put that code under `if __name__ == "__main__":` (or '
            "pass client=distributed.Client(...))"
        )
    try:
        return EmbeddedCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
            preload=_worker_preloads(),
        )
    except RuntimeError as exc:  # "Nanny failed to start": say the likely cause
        raise ConfigError(MAIN_GUARD_HINT) from exc


def embedded_worker_count(device: str, *, cores: int, gpus: int, needed: int = 1) -> int:
    """How many worker processes an embedded LocalCluster starts: one per GPU where the
    fit trains on GPUs (a replica per GPU: more would share one, and NCCL refuses two
    ranks on a GPU), or one for ``device="cuda:K"``, at least ``needed`` (the workers a
    fixed replica count or a spatial layout asks for); one per core on the CPU. Pure."""
    if gpus < 1 or device.startswith("cpu"):
        return cores
    return max(1 if ":" in device else gpus, needed)


def _gpus_here() -> int:
    """The GPUs torch sees in this process (counted without starting CUDA where the
    driver's NVML allows)."""
    import torch

    return torch.cuda.device_count()


def _worker_preloads() -> list[str]:
    """Dask's configured worker preloads, and the one that makes the embedded cluster's
    workers ignore Ctrl-C (the driver stops them: ``runtime/interrupt.py``)."""
    configured = dask.config.get("distributed.worker.preload", None) or []
    return [*([configured] if isinstance(configured, str) else configured), WORKER_PRELOAD]


def check_scheduler(address: str) -> None:
    """Connect to ``address`` once, on a loop of its own, within Dask's connect timeout
    (``distributed.comm.timeouts.connect``). Probing first, not ``Client(address)``: a Client
    whose connection failed blocks for twice the timeout again when it is collected."""
    timeout = dask.config.get("distributed.comm.timeouts.connect")

    async def probe() -> None:
        comm = await connect(address, timeout=timeout)
        await comm.close()

    runner = LoopRunner(asynchronous=False)
    runner.start()
    try:
        sync(runner.loop, probe)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"client={address!r}: no Dask scheduler answered at that address ({exc}); check "
            "the address the scheduler printed ('Scheduler at: tcp://host:8786') and that it "
            "is running, or pass client=None for an embedded LocalCluster"
        ) from exc
    finally:
        runner.stop()


@contextlib.contextmanager
def client_or_local_cluster(
    client: Client | Cluster | str | None,
    *,
    n_workers: int | None = None,
    device: str = "auto",
    needed: int = 1,
    announce: bool = True,
) -> Iterator[Client]:
    """The client to run on, for the block:

    - a ``distributed.Client``: as is (left open: it is the caller's);
    - a scheduler address (``"tcp://10.0.0.5:8786"``) or a cluster object (``LocalCluster``,
      dask-jobqueue's ``SLURMCluster``): a Client connected to it, closed after the block;
    - ``None``: a LocalCluster, closed after: ``n_workers`` single-threaded processes,
      by default one per GPU where the work runs on ``device``'s GPUs (at least
      ``needed``), else one per core (:func:`embedded_worker_count`); its workers do
      not log the engine's failed tasks, which the fit raises itself, and ignore
      Ctrl-C: a KeyboardInterrupt in the block closes it in bounded time.

    A KeyboardInterrupt in the block leaves one line that says so (``interrupt.py``).
    """
    if isinstance(client, Client):
        with saying_interrupted("the fit stopped, the client stays open"):
            yield client
        return
    if isinstance(client, (str, Cluster)):
        if isinstance(client, str):
            check_scheduler(client)
        with (
            Client(client, set_as_default=False) as connected,
            saying_interrupted("the fit stopped, disconnecting from the cluster"),
        ):
            yield connected
        return
    if client is not None:
        raise ConfigError(_not_a_client(client))
    gpus = 0 if device.startswith("cpu") else _gpus_here()
    n = n_workers or embedded_worker_count(
        device, cores=os.cpu_count() or 1, gpus=gpus, needed=needed
    )
    with contextlib.ExitStack() as closing:
        cluster = start_local_cluster(n)
        closing.callback(cluster.close)
        local = Client(cluster)
        closing.callback(local.close)
        local.register_plugin(QuietEngineFailuresPlugin())  # a replica's error: once
        if announce:
            print(
                f"dataflow: LocalCluster with {n} worker process(es)"
                f"{', one per GPU' if gpus and n == gpus and not n_workers else ''}; "
                f"dashboard {local.dashboard_link}"
            )
        try:
            yield local
        except KeyboardInterrupt:  # Ctrl-C: closed here, in bounded time, not by the stack
            closing.pop_all()  # (a second close would wait for the cut-short first one)
            say_interrupted("the fit stopped, closing its LocalCluster")
            close_quickly(local, cluster)
            raise


ACCEPTED = (
    "a distributed.Client, a scheduler address such as 'tcp://10.0.0.5:8786', a cluster "
    "object (LocalCluster, dask-jobqueue's SLURMCluster), or None for an embedded LocalCluster"
)


def _not_a_client(client: Any) -> str:
    if isinstance(client, type) and issubclass(client, (Client, Cluster)):
        name = client.__name__
        return f"client={name} is a class; pass an instance, {name}(...) (fit takes {ACCEPTED})"
    return f"client={client!r} ({type(client).__name__}) is not a client; pass {ACCEPTED}"


def available_workers(client: Client) -> list[str]:
    """The client's workers, in a stable order (by host, then address)."""
    workers = live_workers(client)
    return sorted(workers, key=lambda a: (workers[a].get("host", ""), a))


def check_client(client: Client) -> None:
    if str(getattr(client, "status", "running")) in ("closing", "closed"):
        raise ConfigError(
            "the client is closed; pass an open distributed.Client, or client=None for "
            "an embedded LocalCluster"
        )
