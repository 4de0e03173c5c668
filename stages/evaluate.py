"""Evaluate: metrics on a held-out source at the end of every N epochs.

Each replica evaluates an equal contiguous shard; the driver combines the
per-replica sums, so the result is the metric over the whole held-out set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dataflow.errors import ConfigError
from dataflow.stages.base import Stage, StepContext
from dataflow.stages.forward import call_model


def accuracy(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fraction of samples whose arg-max class equals the integer target."""
    return (output.argmax(dim=1) == y).float().mean()


@dataclass(kw_only=True, frozen=True)
class EvaluateConfig:
    metrics: dict[str, Callable[..., torch.Tensor]] = field(default_factory=dict)
    every_epochs: int = 1
    batch_size: int = 256

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ConfigError(
                "Evaluate(metrics=...): give at least one metric, e.g. "
                "{'loss': torch.nn.functional.cross_entropy, 'accuracy': stages.accuracy}"
            )
        for key, fn in self.metrics.items():
            if not callable(fn):
                raise ConfigError(f"Evaluate(metrics={{{key!r}: ...}}): metric must be callable")
        if not isinstance(self.every_epochs, int) or self.every_epochs < 1:
            raise ConfigError(f"Evaluate(every_epochs={self.every_epochs!r}): must be an int >= 1")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"Evaluate(batch_size={self.batch_size!r}): must be an int >= 1")


class Evaluate(Stage):
    """Adds ``{"eval": {"count": n, name: sum, ...}}`` to the metrics of an epoch's last step."""

    def __init__(
        self,
        source: Any,
        *,
        metrics: dict[str, Callable[..., torch.Tensor]],
        every_epochs: int = 1,
        batch_size: int = 256,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.source = source
        self.config = EvaluateConfig(
            metrics=dict(metrics), every_epochs=every_epochs, batch_size=batch_size
        )

    def run(self, step: StepContext, *inputs: Any) -> Any:
        spec = step.spec
        if spec.last_in_epoch and (spec.epoch + 1) % self.config.every_epochs == 0:
            step.metrics["eval"] = self.evaluate_shard(step)
        return inputs[0] if inputs else None

    def evaluate_shard(self, step: StepContext) -> dict[str, float]:
        replica = step.replica
        n = self.source.num_samples
        lo = n * replica.rank // replica.world_size
        hi = n * (replica.rank + 1) // replica.world_size
        sums = dict.fromkeys(self.config.metrics, 0.0)
        model = replica.model
        model.eval()
        with torch.no_grad():
            for start in range(lo, hi, self.config.batch_size):
                batch = self.source.read(np.arange(start, min(hi, start + self.config.batch_size)))
                output = call_model(model, batch.x, replica.device)
                y = None if batch.y is None else batch.y.to(replica.device)
                for key, fn in self.config.metrics.items():
                    value = fn(output) if y is None else fn(output, y)
                    sums[key] += float(value) * batch.size
        model.train()
        return {"count": hi - lo, **sums}
