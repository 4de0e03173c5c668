"""Where bench_gpu.py's hand loops run: a CUDA GPU, or the CPU for the smoke run.

Every CUDA-only call of the loops (synchronize, events, pinned memory, the device's
name) lives here beside its CPU equivalent, so that the loops have one code path and
``bench_gpu.py --device cpu --tiny`` (a CPU test) runs the code a GPU session will.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Device:
    """``cuda`` or ``cpu``: the loops' device, with the calls that differ between them."""

    type: str

    @property
    def torch(self) -> torch.device:
        return torch.device(self.type)

    @property
    def cuda(self) -> bool:
        return self.type == "cuda"

    def name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else f"cpu ({platform.processor()})"

    def sync(self) -> None:
        """Wait for every queued kernel (a CPU op has finished when it returns)."""
        if self.cuda:
            torch.cuda.synchronize()

    def upload(self, host: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        """``host`` on the device; ``pinned``: through page-locked memory, not waited for
        (as a user's loop copies host batches)."""
        if not self.cuda:
            return host
        if pinned:
            return host.pin_memory().to(self.torch, non_blocking=True)
        return host.to(self.torch)

    def release(self) -> None:
        """Give cached device memory back before the next side allocates its own."""
        if self.cuda:
            torch.cuda.empty_cache()

    def clock(self) -> StepClock:
        return StepClock(self)


@dataclass
class StepClock:
    """Step end times, read once after the last step: the host never waits for the
    device inside a loop (CUDA events on a GPU, the host clock on the CPU)."""

    device: Device
    _start: object = None
    _marks: list = field(default_factory=list)

    def start(self) -> None:
        self.device.sync()
        self._start = self._now()

    def mark(self) -> None:
        self._marks.append(self._now())

    def ends(self) -> list[float]:
        """Seconds from :meth:`start` to each :meth:`mark`."""
        self.device.sync()
        if self.device.cuda:
            return [self._start.elapsed_time(end) / 1000 for end in self._marks]  # type: ignore[attr-defined]
        return [end - self._start for end in self._marks]  # type: ignore[operator]

    def _now(self) -> object:
        if self.device.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
