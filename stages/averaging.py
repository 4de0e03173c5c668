"""An exponential moving average of the weights (``ema_decay=``), kept as training goes.

The average of the weights over the last few thousand steps generalizes better than
the last weights, and is what many recipes evaluate and ship (timm's ``ModelEma``,
``torch.optim.swa_utils.AveragedModel``). It follows torch's convention: after every
update the optimizer applies, the first copies the weights, each later one is
``ema <- decay * ema + (1 - decay) * w`` (one ``_foreach_lerp_``); a skipped step
(non-finite, an fp16 overflow) leaves it as it is.

It lives in the optimizer's per-parameter state, under :data:`EMA_KEY`, so it goes
wherever the optimizer's state goes: commits and rollbacks, checkpoints and resumes, a
joining replica's snapshot, local updates' average (as ``Local``'s outer momentum
does), and asynchronous updates' parameter store, which moves it at each version it
applies (the replicas take its optimizer state back at each window's end).

A parameter's average starts at its first update: once the optimizer holds state for
it, or it had a gradient (an optimizer without state, plain SGD). One with neither was
never updated and gets none yet, so no state is made before the optimizer's own (Adam
sets a parameter up when its state is empty).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dataflow.core.errors import ConfigError

EMA_KEY = "ema"  # optimizer state key: the parameter's moving average
UPDATES_KEY = "ema_updates"  # with warmup: the updates the average has had (an int)


def warmed_decay(decay: float, updates: int) -> float:
    """``ema_warmup``: the decay of the update after ``updates`` (the first, a copy, is
    update 1): ``min(decay, (1 + updates) / (10 + updates))``, TensorFlow's
    ``ExponentialMovingAverage(num_updates=...)`` rule, so early on the average follows
    the weights closely and only a long fit averages over ``1 / (1 - decay)`` steps."""
    return min(decay, (1 + updates) / (10 + updates))


def check_warmup(warmup: Any, decay: float | None, owner: str) -> bool:
    """``ema_warmup`` as given, or a :class:`ConfigError` naming ``owner`` and the fix."""
    if not isinstance(warmup, bool):
        raise ConfigError(f"{owner}(ema_warmup={warmup!r}): give True or False")
    if warmup and decay is None:
        raise ConfigError(
            f"{owner}(ema_warmup=True) warms up the weights' moving average: give "
            "ema_decay=... too (e.g. 0.999)"
        )
    return warmup


def check_decay(decay: Any, owner: str) -> float | None:
    """``ema_decay`` as given, or a :class:`ConfigError` naming ``owner`` and the fix."""
    if decay is None:
        return None
    if (
        isinstance(decay, bool)
        or not isinstance(decay, (int, float))
        or not math.isfinite(decay)
        or not 0.0 < decay < 1.0
    ):
        raise ConfigError(
            f"{owner}(ema_decay={decay!r}): give the moving average's decay per step, a "
            "number strictly between 0 and 1 (e.g. 0.999: about the last 1,000 steps), or "
            "None for no average"
        )
    return float(decay)


class WeightAverage:
    """Moves each parameter's average towards its weights, after ``optimizer.step()``.

    Once every parameter has its average, the pairs are kept, so a step costs one
    ``_foreach_lerp_`` and no walk over the parameters' states (a ResNet has ~160); they
    are found again when the optimizer's state is replaced (a rollback, a resume: its
    ``load_state_dict`` makes a new one)."""

    def __init__(self, decay: float, warmup: bool = False) -> None:
        self.decay, self.warmup = decay, warmup
        self._pairs: tuple[Any, list[torch.Tensor], list[torch.Tensor], list[dict]] | None = None

    @torch.no_grad()
    def update_(self, optimizer: torch.optim.Optimizer) -> None:
        pairs = self._pairs
        if pairs is None or pairs[0] is not optimizer.state:
            pairs = self._pairs = self._find(optimizer)
        if pairs is not None:
            self._lerp(*pairs[1:])

    def _lerp(self, averages: list, params: list, states: list[dict]) -> None:
        """One update of the averages towards ``params``; with warmup, by the decay of
        the update count kept in their states (a Python int: no device read)."""
        decay = self.decay
        if self.warmup:
            updates = states[0].get(UPDATES_KEY, 1)
            decay = warmed_decay(decay, updates)
            for state in states:
                state[UPDATES_KEY] = updates + 1
        torch._foreach_lerp_(averages, params, 1.0 - decay)

    def _find(self, optimizer: torch.optim.Optimizer) -> Any:
        """Start the averages a parameter lacks (a copy of its weights, torch's first
        update); the (state, averages, parameters, their states) to move by the lerp,
        kept once every parameter has one, or None when none has one to move yet."""
        averages, params, states, complete = [], [], [], True
        for param in (p for group in optimizer.param_groups for p in group["params"]):
            if not optimizer.state.get(param) and param.grad is None:
                complete = False  # never updated: its state is the optimizer's to set up
                continue
            state = optimizer.state[param]
            if state.get(EMA_KEY) is None:
                state[EMA_KEY] = param.detach().clone()
                if self.warmup:
                    state[UPDATES_KEY] = 1
                complete = False
            else:
                averages.append(state[EMA_KEY])
                params.append(param)  # the parameter itself: its data may be rebound
                states.append(state)
        if complete:
            self._pairs = (optimizer.state, averages, params, states)
            return self._pairs
        if averages:  # moved this once; looked for again next step
            self._lerp(averages, params, states)
        self._pairs = None
        return None


class SwappedIn:
    """Scoring the average with the model itself (a spatial layout's model exchanges
    halos with its peers: it cannot be copied): ``with swapped:`` the parameters hold
    their averages, and after it their weights again. Two copies of the parameters, a
    small cost beside a batch's forward pass."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        pairs = []
        for param in model.parameters():
            state = optimizer.state.get(param)
            if state and state.get(EMA_KEY) is not None:
                pairs.append((param, state[EMA_KEY]))
        self.params = [p for p, _ in pairs]
        self.averages = [a for _, a in pairs]
        self.weights = [p.detach().clone() for p in self.params]  # (refreshed each time)

    @torch.no_grad()
    def __enter__(self) -> SwappedIn:
        if self.params:
            torch._foreach_copy_(self.weights, self.params)
            torch._foreach_copy_(self.params, self.averages)
        return self

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        if self.params:
            torch._foreach_copy_(self.params, self.weights)


def averaged_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, torch.Tensor] | None:
    """The model's state dict with each averaged parameter's average in place of its
    weights (buffers, and parameters without an average, as the model holds them), as
    host copies; None when no parameter has an average."""
    if optimizer is None:
        return None
    averages = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        state = optimizer.state.get(param)
        if state and state.get(EMA_KEY) is not None:
            averages[name] = state[EMA_KEY]
    if not averages:
        return None
    return {
        name: averages.get(name, value).detach().to("cpu", copy=True)
        for name, value in model.state_dict().items()
    }
