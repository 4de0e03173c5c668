"""What a fit measured and how it is shown: the typed records of each step, epoch,
phase and failure (:mod:`~dataflow.history.records`, pure), the :class:`History` and
:class:`FitResult` a fit returns (:mod:`~dataflow.history.result`), and the training
report drawn from them (:mod:`~dataflow.history.report`).

``History`` and ``FitResult`` are imported on first use, so that the driver's state
machine can build records without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FitResult", "History"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("dataflow.history.result"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dataflow.history' has no attribute {name!r}")
