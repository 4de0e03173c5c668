"""Clipping the gradient by its global norm, with no host read.

``Update(clip_grad_norm=c)`` scales the gradient the optimizer applies by
``min(1, c / (|g| + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does, on the
gradient of the global batch under synchronous updates (the same on every replica, so
the replicas stay identical), on each replica's own gradient under local updates, and on
each gradient a replica pushes under asynchronous ones. The norm and the factor stay on
the device (a 0-d tensor): the norm is read with the window's losses, never per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dataflow.core.errors import ConfigError

GRAD_NORM = "grad_norm"  # step.metrics key: the gradient's norm before clipping (0-d tensor)


def check_max_norm(value: Any, owner: str) -> float | None:
    """``clip_grad_norm=`` as given: None (no clipping), or a number > 0 (``inf``: the
    norm is recorded, nothing is clipped)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"{owner}(clip_grad_norm={value!r}): give the largest gradient norm an update may "
            "apply, a number > 0 (e.g. 1.0), float('inf') to record the norm without "
            "clipping, or None"
        )
    return float(value)


def gradient_norm(params: Sequence[torch.Tensor], grad_sq: Any = None) -> torch.Tensor:
    """The 2-norm of the gradients of ``params``, a 0-d tensor on their device. From
    ``grad_sq`` when the step knows it already (AllReduce's squared norm of the reduced
    gradient, computed anyway), else one ``_foreach_norm`` pass."""
    if grad_sq is not None:
        if isinstance(grad_sq, torch.Tensor):
            return grad_sq.detach().reshape(()).sqrt()
        return torch.tensor(math.sqrt(grad_sq), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads, 2.0)


def clip_gradients_(
    params: Sequence[torch.Tensor], max_norm: float, grad_sq: Any = None
) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so their norm is at most ``max_norm``;
    returns the norm before (on the device, not read)."""
    norm = gradient_norm(params, grad_sq)
    if math.isfinite(max_norm):
        with_grads = [p for p in params if p.grad is not None]
        if with_grads:
            total = norm.to(with_grads[0].grad.device, torch.float32)
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total)
    return norm
