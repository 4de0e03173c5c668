"""An in-memory source uploaded once to the GPU, its batches gathered there.

A batch read from host memory costs a gather on one host thread, a copy into pinned
memory and a transfer: for small images at GPU speed that, not the step, sets the
pace (bench_gpu: the fit ran at the pinned hand loop's rate, 0.75x the loop whose data
sits on the GPU). A dataset that fits in a fraction of the device's free memory is
better copied there once per fit; each step then gathers its samples with one
``index_select`` on the device.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dataflow.core.errors import ConfigError
from dataflow.io.array_source import ArraySource

# Of the device memory free when the replica is built: the rest is the model's,
# its activations' and the optimizer's.
DEFAULT_BUDGET = 0.25
DATA_ON_DEVICE = ("auto", True, False)


def source_bytes(source: ArraySource) -> int:
    return sum(t.numel() * t.element_size() for t in (source.x, source.y) if t is not None)


def device_copy(
    source: Any, device: torch.device, mode: bool | str = "auto", budget: float = DEFAULT_BUDGET
) -> ArraySource | None:
    """``source`` on ``device`` when ``mode`` asks for it and it can be: an in-memory
    source (:class:`ArraySource`) on a CUDA device, whose arrays fit in ``budget`` of the
    device's free memory ("auto"; True also uploads a larger one and raises if the source
    is not in memory). None: read batches from host memory as before."""
    if mode is False or device.type != "cuda":
        return None
    if not isinstance(source, ArraySource):
        if mode is True:
            raise ConfigError(
                f"data_on_device=True: {type(source).__name__} is read chunk by chunk, not "
                "held in memory; give an ArraySource, or leave data_on_device='auto'"
            )
        return None
    if mode == "auto":
        free, _ = torch.cuda.mem_get_info(device)
        if source_bytes(source) > budget * free:
            return None
    resident = copy.copy(source)
    resident.x = source.x.to(device)
    resident.y = None if source.y is None else source.y.to(device)
    return resident
