"""Forward: build the replica's model once, then compute the local mean loss per step."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.errors import ConfigError, LossError, ModelError
from dataflow.stages.base import Batch, ForwardOutput, ReplicaContext, Stage, StepContext


def call_model(model: torch.nn.Module, x: Any, device: torch.device | None = None) -> Any:
    """``model(x)``, or ``model(*x)`` for several inputs (``ZarrSource(x=[...])``)."""
    if isinstance(x, tuple):
        return model(*(v if device is None else v.to(device) for v in x))
    return model(x if device is None else x.to(device))


def build_model(factory: Callable[[], Any], seed: int) -> torch.nn.Module:
    """Call the model factory under ``seed``; refuse anything but an ``nn.Module``."""
    torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ModelError(
            f"model factory {getattr(factory, '__name__', factory)!r} returned "
            f"{type(model).__name__}, not a torch.nn.Module; pass the model class or a "
            "function that returns a new module, e.g. model=lambda: MyNet(width=32)"
        )
    return model


def compute_loss(loss_fn: Callable[..., Any], output: Any, y: Any) -> torch.Tensor:
    """``loss_fn(output, y)`` (``loss_fn(output)`` without targets), checked to be a scalar."""
    loss = loss_fn(output) if y is None else loss_fn(output, y)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossError(
            f"loss function {getattr(loss_fn, '__name__', loss_fn)!r} returned {shape}, "
            "not a scalar tensor; reduce it to the batch mean (e.g. reduction='mean')"
        )
    return loss


@dataclass(kw_only=True, frozen=True)
class ForwardConfig:
    model: Callable[[], torch.nn.Module]
    loss: Callable[..., torch.Tensor]

    def __post_init__(self) -> None:
        if not callable(self.model):
            raise ConfigError(
                f"Forward(model=...): expected a model class or factory, got "
                f"{type(self.model).__name__}"
            )
        if not callable(self.loss):
            raise ConfigError(
                f"Forward(loss=...): expected a function (output, y) -> scalar tensor, got "
                f"{type(self.loss).__name__}"
            )


class Forward(Stage):
    """Runs ``loss(model(x), y)``; the model is built from the factory on each replica.

    ``model`` may be a factory (called with no arguments) or a module instance,
    which is deep-copied into each replica as the initial weights.
    """

    def __init__(
        self,
        model: Callable[[], torch.nn.Module] | torch.nn.Module,
        loss: Callable[..., torch.Tensor],
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        if isinstance(model, torch.nn.Module):
            template = model
            model = lambda: copy.deepcopy(template)  # noqa: E731
        self.config = ForwardConfig(model=model, loss=loss)

    per_micro_batch = True

    def setup(self, replica: ReplicaContext) -> None:
        model = build_model(self.config.model, replica.seed)
        replica.model = model.to(replica.device).train()

    def run(self, step: StepContext, batch: Batch) -> ForwardOutput:
        if batch.size == 0:  # this replica has no samples in this step
            return ForwardOutput(loss=None, output=None, batch=batch)
        output = call_model(step.replica.model, batch.x)
        loss = compute_loss(self.config.loss, output, batch.y)
        if step.micro_count > 1:  # accumulating: each micro-batch's share of the local mean
            loss = loss * step.micro_weight
            step.metrics["loss"] = step.metrics.get("loss", 0.0) + loss.detach()
        else:
            step.metrics["loss"] = loss.detach()
        return ForwardOutput(loss=loss, output=output, batch=batch)
