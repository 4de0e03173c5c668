"""The contracts between layers, apart from their implementations.

A new data source, collective or schedule implements one of these; the engine
depends only on them. A source that stores samples in chunks also implements
:class:`ChunkedSource`, and Load then decodes each chunk once per epoch; a
kernel is a :class:`Kernel` (``dataflow.ops.registry.Op``): a CPU kernel, a CUDA
kernel and the reference both are tested against. (Stages subclass
:class:`dataflow.stages.Stage`, whose methods all have defaults.)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from dataflow.balance import Balancer
from dataflow.io.chunk_reader import ChunkedSource
from dataflow.ops.registry import Op as Kernel
from dataflow.schedule import Schedule
from dataflow.stages.base import Batch, Stage


@runtime_checkable
class Source(Protocol):
    """Samples along a leading dimension, read by index (what ``stages.Load`` needs)."""

    shuffle: bool

    @property
    def num_samples(self) -> int: ...

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices``, in that order."""
        ...


@runtime_checkable
class Collective(Protocol):
    """What the allreduce needs from a process group over the replicas."""

    rank: int
    world_size: int

    def allreduce_async(self, tensor: torch.Tensor) -> Any:
        """Start an in-place sum; return a handle with ``wait()``."""
        ...

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None: ...

    def abort(self) -> None: ...


__all__ = ["Balancer", "ChunkedSource", "Collective", "Kernel", "Schedule", "Source", "Stage"]
