"""Transform: apply a function to the batch inputs (e.g. a ``dataflow.ops`` kernel)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.stages.base import Batch, Stage, StepContext


@dataclass(kw_only=True, frozen=True)
class TransformConfig:
    fn: Callable[[Any], Any]
    apply_to: str = "x"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(
                f"Transform(fn=...): expected a callable on tensors, got {type(self.fn).__name__}"
            )
        if self.apply_to not in ("x", "y"):
            raise ConfigError(f"Transform(apply_to={self.apply_to!r}): must be 'x' or 'y'")


class Transform(Stage):
    """``batch.x = fn(batch.x)`` (or ``y`` with ``apply_to="y"``); empty batches pass.

    A ``fn`` with ``wants_seed = True`` (the random ops of ``dataflow.ops``) is called
    as ``fn(x, seed=(fit seed, step index, replica rank))``, so its random choices are
    reproducible and differ per step and replica.
    """

    def __init__(self, fn: Callable[[Any], Any], *, apply_to: str = "x", name: str | None = None):
        super().__init__(name or f"Transform[{getattr(fn, '__name__', type(fn).__name__)}]")
        self.config = TransformConfig(fn=fn, apply_to=apply_to)

    def run(self, step: StepContext, batch: Batch) -> Batch:
        if batch.size:
            value = getattr(batch, self.config.apply_to)
            fn = self.config.fn
            if getattr(fn, "wants_seed", False):  # random ops: reproducible per step and replica
                seed = (step.replica.seed, step.spec.index, step.replica.rank)
                setattr(batch, self.config.apply_to, fn(value, seed=seed))
            else:
                setattr(batch, self.config.apply_to, fn(value))
        return batch
