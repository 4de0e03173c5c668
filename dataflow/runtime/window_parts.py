"""Small pure helpers of a replica's window: micro-batch groups and sizes, per-step
losses from the parts trained. Kept apart from
:mod:`dataflow.runtime.replica`, which runs the window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dataflow.core.digest import sample_digest


def update_config(stages: Any) -> Any:
    """The config of the graph's Update stage: the first with an optimizer factory (a
    parameter store builds the same optimizer, and keeps the same moving average, over
    its shard of the parameters)."""
    for stage in stages:
        config = getattr(stage, "config", None)
        if callable(getattr(config, "optimizer", None)):
            return config
    raise RuntimeError("sync.Async needs an Update stage with an optimizer factory")


def optimizer_factory(stages: Any) -> Any:
    """The optimizer factory of the graph's Update stage."""
    return update_config(stages).optimizer


def micro_batch_groups(order: tuple[str, ...], stages: dict[str, Any]) -> list[tuple[str, ...]]:
    """The stage order cut into groups: each run of consecutive ``per_micro_batch`` stages
    (Forward, Backward) is one group, run once per micro-batch; every other stage alone."""
    groups: list[tuple[str, ...]] = []
    for name in order:
        if stages[name].per_micro_batch and groups and stages[groups[-1][-1]].per_micro_batch:
            groups[-1] = (*groups[-1], name)
        else:
            groups.append((name,))
    return groups


def step_losses(
    losses: list[float | None], offsets: list[int], sizes: list[int], count: int
) -> list[float | None]:
    """Per step of the window, the sample-weighted mean loss of the parts this replica
    trained of it (None for a step it trained no part of, or without a loss)."""
    total, weight = [0.0] * count, [0] * count
    seen = [False] * count
    for loss, offset, size in zip(losses, offsets, sizes, strict=True):
        if loss is None:
            continue
        seen[offset] = True
        total[offset] += loss * size
        weight[offset] += size
    return [
        (total[k] / weight[k] if weight[k] else total[k]) if seen[k] else None for k in range(count)
    ]


def to_floats(values: list[Any]) -> list[float | None]:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [None if v is None else float(v) for v in values]
    flat = iter(torch.stack([t.detach().float() for t in tensors]).cpu().tolist())
    return [next(flat) if isinstance(v, torch.Tensor) else v for v in values]


def host_pairs(pairs: list[tuple], skipped: Sequence[int] = ()) -> list[tuple]:
    """A window's gradient-norm pairs ``(step, small, small_sq, big, big_sq)`` with their
    squared norms on the host as floats: AllReduce leaves them on the device (0-d
    tensors), so a window reads them in one transfer per device here instead of one
    host sync per step. Pairs of ``skipped`` steps (their update dropped: not finite,
    or an fp16 overflow) are left out; the estimate is fed from steps that trained."""
    drop = set(skipped)
    pairs = [pair for pair in pairs if pair[0] not in drop]
    groups: dict[tuple, list[torch.Tensor]] = {}  # 0-d tensors by device and dtype
    for pair in pairs:
        for value in pair:
            if isinstance(value, torch.Tensor):
                groups.setdefault((value.device, value.dtype), []).append(value)
    if not groups:
        return [tuple(pair) for pair in pairs]
    host: dict[int, float] = {}
    for tensors in groups.values():
        values = torch.stack(tensors).reshape(-1).tolist()  # one read per device
        host.update(zip(map(id, tensors), values, strict=True))
    return [
        tuple(host[id(v)] if isinstance(v, torch.Tensor) else v for v in pair) for pair in pairs
    ]


def host_indices(indices: Any) -> Any:
    return indices.cpu().numpy() if isinstance(indices, torch.Tensor) else indices


def add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class WindowTally:
    """What a replica's window adds up as its tasks run: per step of the window, the
    samples, seconds and store waits; per task, the loss; the parts taken over or
    retrained; the steps skipped (not finite); the digest of the samples read; noise
    pairs; epoch ends to evaluate."""

    def __init__(self, first_step: int, stop_step: int) -> None:
        count = stop_step - first_step
        self.first, self.count = first_step, count
        self.samples, self.seconds, self.waits = [0] * count, [0.0] * count, [0.0] * count
        self.lrs: list[float | None] = [None] * count
        self.losses: list[Any] = []
        self.grad_norms: list[Any] = []  # per task, with clip_grad_norm (0-d tensors)
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.taken: list[tuple[int, int]] = []
        self.retrained: list[tuple[int, int]] = []
        self.skipped: list[int] = []  # steps whose update was dropped (not finite)
        self.pairs: list[Any] = []
        self.epoch_ends: list[Any] = []
        self.read = 0
        # each step's sample indices, hashed once at the window's end (``digest``): the
        # digest is a sum, and per step its numpy calls cost more than the hashing
        self.indices: list[Any] = []

    def add(self, step: Any, seconds: float) -> None:
        """One task done: ``step`` (a StepContext) ran in ``seconds``."""
        offset = step.spec.index - self.first
        self.seconds[offset] += seconds
        self.samples[offset] += step.local_batch
        self.losses.append(step.metrics.get("loss"))
        self.grad_norms.append(step.metrics.get("grad_norm"))
        self.lrs[offset] = step.metrics.get("lr", self.lrs[offset])
        self.offsets.append(offset)
        self.sizes.append(step.local_batch)
        if step.part is not None:
            self.taken.append((step.spec.index, step.part))
        if step.metrics.get("skipped") or step.metrics.get("overflow"):
            # Update dropped it (on_non_finite="skip", or fp16's scaled gradient overflowed)
            self.skipped.append(step.spec.index)
        indices = step.metrics.get("sample_indices")
        if indices is not None:  # the driver knows them from the plan: prove them
            self.read += len(indices)
            self.indices.append(host_indices(indices))
        self.pairs.extend(step.metrics.get("norm_pairs", ()))
        if "store_wait_s" in step.metrics:
            self.waits[offset] += step.metrics["store_wait_s"]
        if step.spec.last_in_epoch and step.part is None:  # evaluations: after end_window
            self.epoch_ends.append(step)

    @property
    def digest(self) -> int | None:
        """The digest of every sample the window's tasks read (None: no task reported
        its samples)."""
        if not self.indices:
            return None
        flat = [np.asarray(i, dtype=np.int64).reshape(-1) for i in self.indices]
        return sample_digest(np.concatenate(flat))

    def step_losses(self) -> list[float | None]:
        return step_losses(to_floats(self.losses), self.offsets, self.sizes, self.count)

    def step_grad_norms(self) -> list[float | None]:
        """Per step, the gradient norm before clipping (one read per window; the
        sample-weighted mean of the parts' norms where a replica trained several); [] when
        nothing clips."""
        if all(norm is None for norm in self.grad_norms):
            return []
        return step_losses(to_floats(self.grad_norms), self.offsets, self.sizes, self.count)
