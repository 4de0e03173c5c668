"""A lost replica's window result, when its partners finished the window without it:
its samples follow from the plan (and, with sample leases, from what the others report),
its losses and times are unknown. Pure."""

from __future__ import annotations

from typing import Any

from dataflow.core.window import WindowResult


def salvaged_result(specs: tuple, rank: int) -> WindowResult:
    """The result of replica ``rank`` lost after it finished the window (its partners
    could not have finished without it): its samples from the plan, its losses and
    times unknown."""
    return WindowResult(
        rank=rank,
        first_step=specs[0].index,
        samples=[spec.local_batches[rank] for spec in specs],
        losses=[None] * len(specs),
        step_seconds=[0.0] * len(specs),
        stage_seconds={},
        task_seconds=0.0,
    )


def salvage_leased(filled: list[Any], salvaged: list[int], specs: tuple) -> None:
    """Sample leases and a replica lost after its window finished: which parts it
    trained is unknown, but every part of every step was trained exactly once, so its
    samples are each step's global batch less what the others report (split over
    several lost replicas by their planned shares)."""
    known = [w for rank, w in enumerate(filled) if rank not in salvaged]
    for i, spec in enumerate(specs):
        left = spec.global_batch - sum(w.samples[i] for w in known)
        planned = [spec.local_batches[rank] for rank in salvaged]
        shares = [left * p // max(sum(planned), 1) for p in planned]
        shares[0] += left - sum(shares)
        for rank, share in zip(salvaged, shares, strict=True):
            filled[rank].samples[i] = share
