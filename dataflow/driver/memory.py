"""Batches that fit the device, pure: what an out-of-memory error in a window leads to
(the micro-batch cap halved), and the cap a measured peak memory per sample allows.

No torch, no Dask: the executor names an error out-of-memory by its type's name and
module, the machine halves the cap from the plan the failed window ran, and the
planner takes the smaller of the user's ``max_micro_batch`` and the learned cap.
"""

from __future__ import annotations

import itertools
from typing import Any

from dataflow.core.errors import ReplicaError

SAFE_FRACTION = 0.8  # of the device's free memory a measured cap may plan to use


def is_out_of_memory(error: BaseException | None) -> bool:
    """``error``, or an error it was raised from, is torch's out-of-memory error
    (``torch.OutOfMemoryError``, which ``torch.cuda.OutOfMemoryError`` is)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        kind = type(error)
        if kind.__name__ == "OutOfMemoryError" and kind.__module__.split(".")[0] == "torch":
            return True
        error = error.__cause__ or error.__context__
    return False


def largest_micro_batch(plan: Any, window: Any, rank: int) -> int:
    """The most samples replica ``rank`` held in one forward/backward of ``window``:
    its local batch over its micro-batch count, rounded up, over the window's steps."""
    sizes = [
        spec.micro_batch_size_of(rank)
        for spec in plan.steps[window.first : window.stop]
        if rank < len(spec.local_batches)
    ]
    return max(sizes, default=0)


def largest_planned(steps: Any, start: int) -> int:
    """The most samples any replica holds at once in ``steps`` from index ``start`` on."""
    return max(
        (
            spec.micro_batch_size_of(r)
            for spec in steps
            if spec.index >= start
            for r in range(len(spec.local_batches))
        ),
        default=0,
    )


def halved_cap(ran: int, cap: int | None) -> int:
    """The next micro-batch cap after a replica ran out of memory holding ``ran`` samples
    at once (``cap``: the cap learned so far, None: none): half of what ran; 0 when a
    single sample did not fit."""
    held = ran if cap is None else min(ran, cap)
    return held // 2


def out_of_memory_error(
    error: Any, *, rank: int, ran: int, halvings: int, budget: int, phase: Any
) -> ReplicaError:
    """The error a fit stops with when halving the micro-batch cap cannot help."""
    if ran <= 1:
        why = (
            "with micro-batches of 1 sample: one sample does not fit the device; use a "
            "smaller model or input, precision='bf16', or a spatial layout (Layout(spatial=P))"
        )
    else:
        why = (
            f"with micro-batches of {ran} samples, after {halvings} halvings of the "
            f"micro-batch cap in this phase (at most {budget}); set max_micro_batch below "
            f"{ran}, or free the device's memory"
        )
    failure = ReplicaError(f"replica {rank} ran out of device memory in phase {phase} {why}")
    # (a replayed log holds the error's name and message, not the exception)
    failure.__cause__ = error if isinstance(error, BaseException) else None
    return failure


def measured_cap(results: Any, fraction: float = SAFE_FRACTION) -> int | None:
    """The micro-batch cap the replicas' memory measurements allow (the tightest over
    them; None: none measured, as off CUDA): each replica's peak per sample held,
    against ``fraction`` of the memory its step could use."""
    caps = []
    # a phase's first window on CUDA measures; the rest hold none: skip them in C (map)
    measured = filter(
        None, map(getattr, results, itertools.repeat("memory"), itertools.repeat(None))
    )
    for memory in measured:
        if memory.get("samples", 0) > 0:
            per_sample = memory["peak_bytes"] / memory["samples"]
            cap = memory_cap(per_sample, memory["usable_bytes"], fraction=fraction)
            if cap is not None:
                caps.append(cap)
    return min(caps, default=None)


def memory_cap(
    peak_bytes_per_sample: float,
    free_bytes: float,
    *,
    base_bytes: float = 0.0,
    fraction: float = SAFE_FRACTION,
) -> int | None:
    """The most samples a forward/backward may hold on a device with ``free_bytes`` free
    (before the step: weights and optimizer state already in), given the measured peak
    ``peak_bytes_per_sample`` above ``base_bytes`` (what the step holds whatever its
    batch): ``floor((fraction x free - base) / per sample)``, at least 1. None when
    nothing was measured."""
    if peak_bytes_per_sample <= 0 or free_bytes <= 0:
        return None
    room = fraction * free_bytes - max(0.0, base_bytes)
    return max(1, int(room // peak_bytes_per_sample))
