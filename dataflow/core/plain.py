"""Plain data: the one sanitiser for what a fit saves (checkpoints, history JSON, manifests).

:func:`to_plain` turns nested records into numbers, strings and plain containers, in one
of two forms:

- the stored form (default), for ``torch.save`` read back with ``weights_only=True``:
  tensors (detached), torch dtypes, sizes and devices are kept, tuples stay tuples,
  mapping keys are kept, NaN and infinities stay floats;
- the JSON form (``json=True``), for strict JSON: mapping keys become strings, tuples
  become lists, non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``
  (what ``json.dumps`` accepts without writing the non-standard ``NaN``), tensors and
  bytes are refused.

In both, numpy scalars become Python numbers and numpy arrays lists, and anything else
(a dataclass, a set, an arbitrary object) raises :class:`NotPlainError` naming where in
the value it sits (``where``, e.g. ``"Checkpoint.schedule_state['phase']"``).

Importing this module does not import torch (``dataflow.core`` stays light): torch
objects are recognised when torch is loaded, as it is wherever one exists.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from dataflow.core.errors import DataflowError

_SCALARS = (bool, int, float, str)


class NotPlainError(DataflowError, TypeError):
    """A value holds something that is not plain data (names where, and what it is)."""


def to_plain(value: Any, *, where: str | None = None, json: bool = False) -> Any:
    """``value`` as plain data (see the module docstring for the two forms); new
    containers, the input is not changed. Raises :class:`NotPlainError` naming
    ``where`` (default ``"value"``) and the path inside it for anything else."""
    return _plain(value, "value" if where is None else where, json)


def _plain(value: Any, where: str, json: bool) -> Any:
    if value is None or isinstance(value, _SCALARS):
        if json and isinstance(value, float) and not math.isfinite(value):
            return str(float(value))  # "nan", "inf", "-inf" (also for float subclasses)
        return value
    if isinstance(value, np.generic):
        return _plain(value.item(), where, json)  # np.float32 NaN -> "nan" in JSON too
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), where, json)
    if not json:
        if isinstance(value, bytes):
            return value
        torch = sys.modules.get("torch")  # not imported: no value can be a tensor
        if torch is not None:
            if isinstance(value, torch.Tensor):
                return value.detach()
            if isinstance(value, torch.dtype | torch.Size | torch.device):  # Size: a tuple
                return value
    if isinstance(value, Mapping):
        return {
            (str(k) if json else k): _plain(v, f"{where}[{k!r}]", json) for k, v in value.items()
        }
    if isinstance(value, tuple) and not json:
        return tuple(_plain(v, f"{where}[{i}]", json) for i, v in enumerate(value))
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]", json) for i, v in enumerate(value)]
    if json:
        raise NotPlainError(
            f"{where} holds a {type(value).__name__}, which JSON cannot hold; convert it to "
            "numbers, strings, lists or dicts"
        )
    raise NotPlainError(
        f"{where} holds a {type(value).__name__}, which is not plain data; convert it to "
        "numbers, strings, lists, dicts or tensors"
    )
