"""What a phase's first window measures of the device's memory on CUDA: the peak it
allocated above what the replica holds between steps, the most samples one forward and
backward held, and the memory the step could use. The driver turns it into a
micro-batch cap (``dataflow.driver.memory.measured_cap``)."""

from __future__ import annotations

from typing import Any

import torch


class MemoryProbe:
    """Started before a window on ``device`` (CUDA), finished after it."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device, self.cuda = device, cuda or torch.cuda
        self.cuda.reset_peak_memory_stats(device)

    def finish(self, samples: int) -> dict[str, float]:
        """``samples``: the most one forward/backward of the window held. What stays
        allocated after the window (weights, gradients, optimizer state, created in a
        fit's first step) does not grow with the batch: the peak above it does."""
        cuda, device = self.cuda, self.device
        held = cuda.memory_allocated(device)
        free, _ = cuda.mem_get_info(device)
        # What a step may use beyond what stays: the device's free memory and what
        # torch's allocator keeps cached.
        usable = free + cuda.memory_reserved(device) - held
        return {
            "peak_bytes": float(cuda.max_memory_allocated(device) - held),
            "samples": float(samples),
            "usable_bytes": float(usable),
        }


def largest_micro_batch(steps: dict[int, Any], first: int, stop: int, rank: int) -> int:
    """The most samples replica ``rank`` held in one forward/backward of steps
    ``[first, stop)`` (``steps``: the phase's StepSpecs by index)."""
    sizes = [
        spec.micro_batch_size_of(rank)
        for index in range(first, stop)
        if (spec := steps.get(index)) is not None and rank < len(spec.local_batches)
    ]
    return max(sizes, default=0)
