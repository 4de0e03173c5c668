"""Per step of a committed window, the values its replicas reported, made one: the
loss and the gradient norm (weighted by the samples each replica trained) and the LR.
Pure functions of the replicas' window results, apart from the recorder that writes
them into the history."""

from __future__ import annotations

from typing import Any

import numpy as np


def mean_losses(losses: list[list[Any]], samples: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Per step, the loss of the replicas whose losses are ``known``, weighted by their
    samples (``losses``: per replica, per step; None reads as NaN)."""
    values = np.array(losses, dtype=float)
    weighted = np.where(known, values * samples, 0.0).sum(axis=0)
    return weighted / np.maximum(np.where(known, samples, 0).sum(axis=0), 1)


def step_lrs(window: list[Any], count: int) -> list[float | None]:
    """Per step of a window, the LR its update ran at, as the first replica that trained
    a part of it reported (every replica sets the same LR for a step)."""
    lrs: list[float | None] = [None] * count
    for result in window:
        for i, lr in enumerate(getattr(result, "lrs", ())[:count]):
            if lrs[i] is None:
                lrs[i] = lr
    return lrs


def step_grad_norms(window: list[Any], samples: np.ndarray, known: np.ndarray) -> list[Any]:
    """Per step of a window, the gradient norm before clipping (``clip_grad_norm``): the
    replicas' norms weighted by the samples each trained (synchronous updates: all the
    reduced gradient's); None where no replica reported one. ``known``: the replicas
    that trained samples of the step and whose values came back (not a lost one's)."""
    count = samples.shape[1]
    rows = [getattr(result, "grad_norms", None) or [None] * count for result in window]
    norms = np.array([[np.nan if v is None else v for v in row[:count]] for row in rows])
    have = known & ~np.isnan(norms)
    weights = np.where(have, samples, 0).sum(axis=0)
    mean = np.where(have, norms * samples, 0.0).sum(axis=0) / np.maximum(weights, 1)
    return [float(mean[i]) if weights[i] > 0 else None for i in range(count)]
