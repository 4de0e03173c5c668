"""Bucketed, overlapped, sample-weighted gradient allreduce.

Each parameter's gradient is copied into its bucket's flat buffer, scaled by this
replica's share of the global batch ``b_r / B``, as soon as autograd has
accumulated it; a full bucket starts its allreduce (a sum) at once, so
communication overlaps the rest of backward. The sum of the weighted gradients is
the mean gradient of the global batch, whatever the split, including replicas with
no samples (they contribute zeros). Buckets start strictly in index order on every
replica, as collectives must be issued in the same order everywhere.

After the allreduce, one launch of :func:`dataflow.ops.grad_squared_norm` over all
buckets gives the reduced gradient's squared norm (``grad_sq``, left on the device: no
host sync), which Update's non-finite check and the noise-scale estimate share. On a
step that measures the noise, each bucket's squared norm is taken as it is packed,
before its allreduce overwrites it; their sum (``local_sq``) stays on the device too.

``wire_dtype=torch.bfloat16`` halves the bytes each allreduce moves (as DDP's bf16
compression hook): the weighted fp32 bucket is rounded to bf16 once, summed in bf16,
and widened back into the fp32 bucket; the local norms are taken before the rounding,
and the parameters, their gradients after the step and the optimizer stay fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from dataflow.core.errors import CollectiveError
from dataflow.ops.flat import grad_squared_norm, pack_scaled_
from dataflow.stages.buckets import assign_buckets


class BucketReducer:
    """``sample_group``: a spatial layout's group collective. Its workers each hold a
    part of their replica's gradient (the parts sum to it), so a measured step sums the
    packed buckets over the group before taking the replica's norm."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        collective: Any,
        *,
        cap_bytes: int,
        sample_group: Any = None,
        wire_dtype: torch.dtype | None = None,
    ):
        self.collective = collective
        self.sample_group = sample_group
        self.params = [p for p in params if p.requires_grad]
        self.buckets = assign_buckets(
            [p.numel() * p.element_size() for p in self.params],
            [(p.dtype, p.device) for p in self.params],
            cap_bytes=cap_bytes,
        )
        self._flat: list[torch.Tensor] = []
        self._views: dict[int, torch.Tensor] = {}
        self._bucket_of: dict[int, int] = {}
        for b, members in enumerate(self.buckets):
            first = self.params[members[0]]
            total = sum(self.params[i].numel() for i in members)
            flat = torch.zeros(total, dtype=first.dtype, device=first.device)
            offset = 0
            for i in members:
                n = self.params[i].numel()
                self._views[i] = flat[offset : offset + n]
                self._bucket_of[i] = b
                offset += n
            self._flat.append(flat)
        # what each bucket's allreduce moves: the fp32 bucket itself, or a narrower copy
        self._wire = [
            flat if wire_dtype in (None, flat.dtype) else torch.empty_like(flat, dtype=wire_dtype)
            for flat in self._flat
        ]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._armed = False
        self._weight = 1.0
        self.measure = False  # this step records the local squared norm (noise scale)
        # |w g_r|^2 of a measured step's packed (weighted) local gradient, 0-d on the device
        self.local_sq: torch.Tensor | None = None
        self.grad_sq: torch.Tensor | None = None  # |G|^2 every step, 0-d on the device

    def begin_step(self, weight: float, measure: bool = False) -> None:
        """Arm the hooks for this step's backward with this replica's weight ``b_r / B``;
        ``measure``: take the local squared norm too (every replica measures the same
        steps: a spatial layout's group reduces its parts for it)."""
        self._weight = weight
        self.measure = measure
        self.local_sq = None
        self.grad_sq = None
        self._local_parts: list[torch.Tensor] = []
        self._group_works: list[Any] = []
        self._pending = [len(m) for m in self.buckets]
        self._packed = [False] * len(self.buckets)
        self._works: list[Any] = [None] * len(self.buckets)
        self._next_launch = 0
        self._armed = True

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        i = self._index[id(param)]
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._pack(b)
            self._launch_ready()

    def _pack(self, b: int) -> None:
        members = self.buckets[b]
        if self._flat[b].is_cuda:  # one launch for the bucket (the tables need no sync)
            grads = [self.params[i].grad for i in members]
            sizes = [self.params[i].numel() for i in members]
            pack_scaled_(self._flat[b], grads, self._weight, sizes=sizes)
        else:  # on the CPU torch's per-tensor copies are faster than the kernel's setup
            for i in members:
                grad = self.params[i].grad
                view = self._views[i]
                if grad is None:
                    view.zero_()
                elif self._weight == 1.0:
                    view.copy_(grad.reshape(-1))
                else:
                    torch.mul(grad.reshape(-1), self._weight, out=view)
        if self.measure and self.sample_group is not None:  # the replica's: sum the parts
            part = self._flat[b].clone()
            self._local_parts.append(part)
            self._group_works.append(self.sample_group.allreduce_async(part))
        elif self.measure:  # before the allreduce overwrites the buffer with the sum
            self._local_parts.append(grad_squared_norm([self._flat[b]]))
        self._packed[b] = True

    def arm(self, armed: bool) -> None:
        """Gradient accumulation: only the last micro-batch's backward packs and reduces."""
        self._armed = armed

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._packed[self._next_launch]:
            b = self._next_launch
            if self._wire[b] is not self._flat[b]:
                self._wire[b].copy_(self._flat[b])  # rounded once, after the local norm
            self._works[b] = self.collective.allreduce_async(self._wire[b])
            self._next_launch += 1

    def finish(self) -> None:
        """Reduce what backward did not (unused params, zero-sample replicas); write back.

        Afterwards every parameter's ``.grad`` is the global-batch mean gradient.
        """
        for b in range(len(self.buckets)):
            if not self._packed[b]:
                self._pack(b)
        self._launch_ready()
        works, self._works = self._works, []
        try:
            for work in works:
                self.collective.wait(work)
        except RuntimeError as exc:  # a peer left: name it as such, the driver looks further
            raise CollectiveError(
                f"allreduce failed on replica {self.collective.rank}: {exc}; another replica "
                "(or the driver) most likely failed first"
            ) from exc
        for flat, wire in zip(self._flat, self._wire, strict=True):
            if wire is not flat:
                flat.copy_(wire)
        self.grad_sq = grad_squared_norm(self._flat)
        if self.measure and self.sample_group is not None:
            group_works, self._group_works = self._group_works, []
            for work in group_works:
                self.sample_group.wait(work)
            self._local_parts = [grad_squared_norm(self._local_parts)]
        if self.measure:  # left on the device: the replica reads it once per window
            parts = self._local_parts
            self.local_sq = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        for i, param in enumerate(self.params):
            reduced = self._views[i].view_as(param)
            if param.grad is None:
                param.grad = reduced.clone()
            else:
                param.grad.copy_(reduced)
        self._armed = False

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
