"""The best epoch's weights on disk, beside a fit's checkpoints (``fit(keep_best=...)``).

``best.pt`` is written as a checkpoint is (a temporary file, fsync, rename, then the
manifest ``best.json`` with its blake2b checksum), so a crash never leaves one that
looks valid, and read with ``torch.load(weights_only=True)``. It holds the weights
(``model_state``: what ``result.best_model`` holds) and what made them the best (the
epoch, the step after it, the metric, its mode and value), with the fit's fingerprint:
a resumed fit keeps the file as the bar its new epochs must beat.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dataflow.checkpoint.fingerprint import compare_fingerprints
from dataflow.checkpoint.format import plain_state
from dataflow.checkpoint.store import BEST_FILE, BEST_MANIFEST, CheckpointStore, read_verified
from dataflow.core.errors import CheckpointError

__all__ = ["best_record", "load_best", "save_best"]

_FIELDS = ("epoch", "step", "metric", "mode", "value")


def save_best(
    store: CheckpointStore,
    model_state: Mapping[str, torch.Tensor],
    *,
    epoch: int,
    step: int,
    metric: str,
    mode: str,
    value: float,
    fingerprint: Mapping[str, Any],
) -> Path:
    """Write ``model_state`` as the best weights in ``store``'s folder, atomically."""
    path = store.directory / BEST_FILE
    record = {"epoch": epoch, "step": step, "metric": metric, "mode": mode, "value": value}
    state = {
        "model_state": dict(model_state),
        **record,
        "fingerprint": plain_state(dict(fingerprint), "fingerprint"),
        "created": time.time(),
    }
    manifest = store.directory / BEST_MANIFEST
    try:
        manifest.unlink(missing_ok=True)  # never the old manifest beside new data
        digest, size = store.write_atomic(path, lambda f: torch.save(state, f))
        text = {
            "file": BEST_FILE,
            "bytes": size,
            "blake2b": digest,
            **record,
            "value": value if math.isfinite(value) else str(value),
            "fingerprint": plain_state(dict(fingerprint), "fingerprint", json=True),
        }
        store.write_atomic(manifest, lambda f: f.write(json.dumps(text, indent=1).encode()))
    except OSError as error:
        raise CheckpointError(
            f"could not write the best weights {path} ({error.strerror or error}); check the "
            f"free space and permissions of {store.directory}"
        ) from error
    return path


def load_best(directory: str | os.PathLike[str], *, map_location: Any = "cpu") -> dict[str, Any]:
    """The best weights a fit with ``keep_best=`` wrote in ``directory`` (its
    ``checkpoint_dir``), checksum verified: ``model_state`` (for
    ``model.load_state_dict``), ``epoch``, ``step``, ``metric``, ``mode``, ``value``,
    ``fingerprint`` and ``created``. A missing or damaged file is a ``CheckpointError``
    naming it."""
    path = Path(directory) / BEST_FILE
    if not path.exists():
        raise CheckpointError(
            f"no best weights in {directory}: {BEST_FILE} is written by a fit with "
            "checkpoint_dir=... and keep_best='<epoch metric>' once an epoch has the metric"
        )
    data = _verified(path)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"{path} matches its checksum but cannot be loaded ({error}); it was not "
            "written by dataflow's keep_best, or by an incompatible version"
        ) from error


def best_record(store: CheckpointStore, fingerprint: Mapping[str, Any]) -> dict[str, Any] | None:
    """What made the best weights in ``store``'s folder the best (epoch, step, metric,
    mode, value), if the file is whole and belongs to the fit of ``fingerprint``; else
    None (a damaged file with a warning naming it: the fit keeps its next best)."""
    path = store.directory / BEST_FILE
    if not path.exists():
        return None
    try:
        _verified(path)
        manifest = json.loads((store.directory / BEST_MANIFEST).read_text())
    except (CheckpointError, OSError, ValueError) as error:
        warnings.warn(f"ignoring the best weights: {error}", RuntimeWarning, stacklevel=2)
        return None
    if compare_fingerprints(manifest.get("fingerprint") or {}, dict(fingerprint)):
        return None  # another run's (a resumed fit's folder holds only its own)
    record = {field: manifest.get(field) for field in _FIELDS}
    record["value"] = float(record["value"])  # (written as "nan" / "inf" when not finite)
    return record


def _verified(path: Path) -> bytes:
    try:
        return read_verified(path)
    except CheckpointError as error:
        raise CheckpointError(
            str(error).replace("resume from an older checkpoint", "it is not used")
        ) from None
