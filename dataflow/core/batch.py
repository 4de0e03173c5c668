"""The values that flow between stages within one step: a batch, Forward's output, and
the gradients marker.

They live in the bottom layer because io builds batches, stages pass them along and
the runtime slices them; none of those may import another for these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "ForwardOutput", "Gradients"]


@dataclass
class Batch:
    """One replica's share of a global batch: inputs, optional targets, sample count."""

    x: Any
    y: Any = None
    size: int = 0
    indices: Any = None  # sample indices in the source, for the sample ledger
    # On a GPU: the event marking the end of its copy to the device (io.device_staging),
    # until the compute stream has been told to wait for it
    ready: Any = None

    def slice(self, start: int, stop: int) -> Batch:
        """Samples ``[start, stop)``: one micro-batch of gradient accumulation (views)."""
        return Batch(
            x=_slice(self.x, start, stop),
            y=_slice(self.y, start, stop),
            size=stop - start,
            indices=None if self.indices is None else self.indices[start:stop],
        )


def _slice(value: Any, start: int, stop: int) -> Any:
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_slice(v, start, stop) for v in value)
    return value[start:stop]


@dataclass
class ForwardOutput:
    """What Forward hands to Backward: the local mean loss and the model output.

    ``captured``: a CUDA graph replay computed the step's gradients too (Forward's
    captured steps, ``stages/capture.py``): Backward has nothing left to do."""

    loss: torch.Tensor | None
    output: Any
    batch: Batch
    captured: bool = False
    # a replica without samples under sync_batchnorm: a zero on its model's (empty)
    # output, whose backward takes part in the peers' BatchNorm reductions
    participation: torch.Tensor | None = None


@dataclass
class Gradients:
    """Marker flowing from Backward onwards: gradients live on ``model.parameters()``.

    ``reduced`` is True once they are the mean gradient of the *global* batch;
    ``applied`` once a parameter store stepped on them (``dataflow.sync.Async``).
    """

    samples: int
    reduced: bool = False
    applied: bool = False  # a parameter store applied them: the weights are its (Async)
