"""Update: apply the optimizer to the reduced gradients."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.errors import ConfigError, ModelError
from dataflow.schedule import lr_at
from dataflow.stages.base import Gradients, PhaseContext, ReplicaContext, Stage, StepContext


@dataclass(kw_only=True, frozen=True)
class UpdateConfig:
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

    def __post_init__(self) -> None:
        if not callable(self.optimizer):
            raise ConfigError(
                "Update(optimizer=...): expected a factory taking the parameters, e.g. "
                "lambda params: torch.optim.SGD(params, lr=0.1)"
            )


def build_optimizer(factory: Callable[..., Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = factory(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelError(
            f"optimizer factory returned {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer; pass e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    return optimizer


class Update(Stage):
    """``optimizer.step()`` then clears the gradients; sets the phase's LR if it has one."""

    def __init__(
        self,
        optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.config = UpdateConfig(optimizer=optimizer)

    def setup(self, replica: ReplicaContext) -> None:
        if replica.model is None:
            raise ConfigError(f"{self.name}: needs a Forward stage upstream to build the model")
        replica.optimizer = build_optimizer(self.config.optimizer, replica.model)
        self._base_lrs = [group["lr"] for group in replica.optimizer.param_groups]

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None:
        """The phase's LR per param group: ``phase.lr``, else the factory's × ``lr_scale``;
        ramped from the current LR over ``warmup_steps`` (set step by step in run)."""
        groups = replica.optimizer.param_groups
        self._start_lrs = [group["lr"] for group in groups]
        if phase.lr is not None:
            self._target_lrs = [phase.lr] * len(groups)
        else:
            self._target_lrs = [base * phase.lr_scale for base in self._base_lrs]
        self._warmup = phase.warmup_steps
        self._first_step = phase.steps[0].index if phase.steps else 0
        self._set_lrs(replica.optimizer, 0)

    def _set_lrs(self, optimizer: torch.optim.Optimizer, step_in_phase: int) -> None:
        for group, start, target in zip(
            optimizer.param_groups, self._start_lrs, self._target_lrs, strict=True
        ):
            group["lr"] = lr_at(start, target, step_in_phase, self._warmup)

    def run(self, step: StepContext, grads: Gradients) -> Gradients:
        optimizer = step.replica.optimizer
        if self._warmup:
            self._set_lrs(optimizer, step.spec.index - self._first_step)
        optimizer.step()
        optimizer.zero_grad()  # the optimizer's default: fused ones keep their flat grads
        return grads
