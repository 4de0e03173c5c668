"""Capture and restore a process's global random states.

Checkpoints (the driver's and each replica's) store these so a resumed run
draws the same numbers; it lives in core because both sides need it.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """This process's global random states: torch CPU, numpy's global RandomState,
    Python's ``random``, and each CUDA device's when CUDA is in use here."""
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [state.clone() for state in torch.cuda.get_rng_state_all()]
    return {
        "torch": torch.get_rng_state().clone(),
        "numpy": (str(kind), torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
        "cuda": cuda,
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the global random states :func:`capture_rng` captured."""
    torch.set_rng_state(state["torch"])
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            warnings.warn(
                f"the checkpoint has the random states of {len(cuda)} CUDA device(s) but "
                f"this process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
                "; CUDA random draws (dropout on GPU) will not repeat those of the saved run",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            torch.cuda.set_rng_state_all(cuda)
