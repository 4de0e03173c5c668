"""Ctrl-C during a fit: a prompt, quiet stop with one line that says so.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group, and the worker
processes of the embedded LocalCluster (``fit(client=None)``) are in the driver's. Left
to Python's default handler, each worker died mid-task printing its own tracebacks, and
the driver's clean-up then waited on comms to the dead workers (Dask's 30 s connect
timeout). So this module is also the workers' preload (``dask_setup``): they ignore
SIGINT, the driver's KeyboardInterrupt stops the fit's replicas on them
(``Executor.close``) and closes the cluster, which ends them.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

CLIENT_CLOSE_S = 5  # after a Ctrl-C: closing the embedded cluster's client...
CLUSTER_CLOSE_S = 10  # ...and the cluster (its nannies end the worker processes)
# Dask's loggers in the driver, which holds the embedded scheduler and nannies: as the
# cluster closes under a fit's queued tasks, the scheduler logs each task it can no longer
# report to the closed client (CRITICAL, with a traceback)
NOISY_LOGGERS = ("distributed", "distributed.client", "tornado", "tornado.application", "asyncio")


def dask_setup(worker: Any) -> None:
    """Preload of the embedded cluster's workers, run as each starts (a nanny's restarted
    worker too) in the worker process's main thread, where signal handlers are set."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # a batch system's notice (SLURM --signal=USR1@120) reaches every process of
        # the job; the driver saves the fit and stops it (driver/stop_signals.py), and
        # the workers, in the driver's process group, must not die of it first
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    worker_logger = logging.getLogger("distributed.worker")
    if not any(isinstance(f, SchedulerClosedHeartbeat) for f in worker_logger.filters):
        worker_logger.addFilter(SchedulerClosedHeartbeat())


class SchedulerClosedHeartbeat(logging.Filter):
    """Drops an embedded worker's "Failed to communicate with scheduler during heartbeat"
    when the scheduler's side of the connection was closed: the scheduler runs in the
    driver's process, so that only happens as the driver closes the cluster (a Ctrl-C,
    the fit's end), where it printed a traceback after the one line a Ctrl-C leaves. A
    heartbeat that times out (a stalled driver) is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "during heartbeat" not in str(record.msg) or not record.exc_info:
            return True
        from distributed.comm.core import CommClosedError

        return not isinstance(record.exc_info[1], CommClosedError)


def say_interrupted(what: str) -> None:
    """The one line a Ctrl-C leaves before Python's KeyboardInterrupt traceback (the fit's
    replicas on the workers are stopped by then: ``Executor.close``)."""
    print(f"dataflow: interrupted; {what}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def saying_interrupted(what: str) -> Iterator[None]:
    """:func:`say_interrupted` ``what`` when the block ends in a KeyboardInterrupt."""
    try:
        yield
    except KeyboardInterrupt:
        say_interrupted(what)
        raise


def close_quickly(client: Any, cluster: Any) -> None:
    """Close the embedded cluster after a Ctrl-C: within ``CLIENT_CLOSE_S`` +
    ``CLUSTER_CLOSE_S``, and with Dask's loggers muted meanwhile."""
    with _muted(NOISY_LOGGERS):
        with contextlib.suppress(Exception):
            client.close(timeout=CLIENT_CLOSE_S)
        with contextlib.suppress(Exception):
            cluster.close(timeout=CLUSTER_CLOSE_S)


@contextlib.contextmanager
def _muted(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
