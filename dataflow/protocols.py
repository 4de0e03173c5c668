"""The contracts between layers, under their public name.

They are defined in :mod:`dataflow.core.protocols` (the bottom layer, so io, ops and
stages can check against them without importing the engine) and re-exported here.
Stages usually subclass :class:`dataflow.stages.Stage`, which implements
:class:`Stage` with defaults; ``dataflow.ops.Op`` is the :class:`Kernel` of the ops.
"""

from __future__ import annotations

from dataflow.core.protocols import (
    Balancer,
    ChunkedSource,
    Collective,
    Kernel,
    Schedule,
    Source,
    Stage,
)

__all__ = ["Balancer", "ChunkedSource", "Collective", "Kernel", "Schedule", "Source", "Stage"]
