"""Workers of the embedded cluster import the engine while the driver is busy.

A fresh worker process imports torch, the engine's stages and torch's compiler
front end (``torch.optim`` imports ``torch._dynamo`` when the first optimizer is
built) only when the fit's first task reaches it: seconds per process, spent while the
driver waits for the replicas to form, after it spent as long checking the pipeline
on two samples (the dry run) with the workers idle. As a preload, this module starts
those imports on a background thread as the worker starts, so they overlap the
driver's own start; a task that needs a module meanwhile waits on Python's import
lock for the import in progress, never imports it twice.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

MODULES = ("torch", "torch._dynamo", "dataflow.runtime.tasks", "dataflow.stages")


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # a warm-up only: the task that needs it will say what is wrong
            return


def dask_setup(worker: Any) -> None:
    """Preload hook: start the imports and return at once (the worker registers now).
    The thread is kept on the worker (``worker.dataflow_warm_start``) for tests."""
    thread = threading.Thread(target=_import_all, name="dataflow-warm-start", daemon=True)
    worker.dataflow_warm_start = thread
    thread.start()
