"""The processes a benchmark starts: their environment (the one this process started
with, not what a LocalCluster wrote into it), a spawned one-call process, pinning a
process to a core, and reading a worker's malloc setting.

Importable by name on the Dask workers (``run_fit`` runs some of these there): it
imports nothing but the standard library."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any


def _child(fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


# The environment this process started with. Starting a LocalCluster writes the Nanny's
# ``distributed.nanny.pre-spawn-environ`` (MALLOC_TRIM_THRESHOLD_, OMP_NUM_THREADS ...)
# into ``os.environ`` of the driver, which later spawned baselines would inherit.
START_ENV = dict(os.environ)


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is exactly ``env`` inside the block (for what is spawned there)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def in_subprocess(fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Any:
    """``fn(*args)`` in a fresh spawned process, in :data:`START_ENV` plus ``env``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with environment({**START_ENV, **(env or {})}):
        process = ctx.Process(target=_child, args=(fn, args, queue))
        process.start()
    status, value = queue.get()
    process.join()
    if status != "ok":
        raise RuntimeError(f"subprocess failed:\n{value}")
    return value


SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def pin_process(core: int) -> int:
    """Pin every thread of this process (and threads it starts later) to one core."""
    cores = sorted(os.sched_getaffinity(0))
    target = {cores[core % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), target)
    return next(iter(target))


def _malloc_env() -> str:
    return f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_')}"
