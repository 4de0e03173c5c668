"""Host-to-GPU copies on a side stream, ahead of use, with an event per batch.

The loader thread assembles each batch in pinned host memory and copies it to the
device on a stream of its own, so the copy of batch n+1 runs on the GPU's copy engine
while the compute stream works on batch n (on the compute stream the copy would queue
behind it). An event recorded after the copy is what the compute stream waits on
before the batch is used: no host synchronisation. Then:

* the pinned host block is reused by torch's caching host allocator only after the
  copy recorded on the side stream has finished, so the loader may drop it at once;
* the device tensors, allocated on the side stream, are marked as used on the compute
  stream (``record_stream``), so the caching allocator does not hand their memory to
  another allocation until the compute stream is done with them.

This is FFCV's slot scheme with the caching allocators as the slots. The device calls
go through a :class:`CudaCopies` (a stand-in in tests checks the order of the calls).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dataflow.core.batch import Batch

__all__ = ["CudaCopies", "DeviceStager"]


class CudaCopies:
    """The CUDA calls the stager makes: one side stream per replica's loader."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    def on_side_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.side)

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        pinned = host if host.is_pinned() else host.pin_memory()
        return pinned.to(self.device, non_blocking=True)

    def copied(self) -> Any:
        """An event marking the side stream's copies so far."""
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def used_on_compute_stream(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))


class DeviceStager:
    """``stage`` on the loader thread, ``hand_over`` on the thread that computes."""

    def __init__(self, copies: Any) -> None:
        self.copies = copies

    def stage(self, batch: Batch) -> Batch:
        with self.copies.on_side_stream():
            batch.x = self._copy(batch.x)
            batch.y = self._copy(batch.y)
            batch.ready = self.copies.copied()
        return batch

    def hand_over(self, batch: Batch) -> Batch:
        """Make the compute stream wait for ``batch``'s copy; once per batch."""
        ready, batch.ready = batch.ready, None
        if ready is not None:
            self.copies.wait(ready)
            for tensor in _tensors(batch.x) + _tensors(batch.y):
                self.copies.used_on_compute_stream(tensor)
        return batch

    def _copy(self, value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(self._copy(v) for v in value)
        if isinstance(value, torch.Tensor):
            return self.copies.copy(value)
        return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, tuple):
        return [t for v in value for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []
