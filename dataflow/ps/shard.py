"""One parameter-store shard: a share of the weights and their optimizer, on a worker.

It lives in the host worker's plugin and runs on that worker's event loop (handlers
of :mod:`dataflow.ps.service`), so a push that must wait for the staleness bound
awaits without holding a thread. Each version applies the pending pushes as one
optimizer step on ``Σ_r f(τ_r) (n_r / B) g_r``, ``f`` the policy's staleness factor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.ps.gate import StalenessGate


@dataclass
class Push:
    grad: torch.Tensor  # this shard's part of the replica's local mean gradient (flat)
    weight: float  # the replica's share of the global batch, n_r / B
    lrs: list[float]  # the replica's LR per param group at this step
    lr_ratio: float  # the same as a ratio to the optimizer's initial LR (group 0)
    finite: bool


class ShardError(RuntimeError):
    """The shard failed (aborted by a replica's error, or timed out waiting)."""


class ParameterShard:
    """Parameters ``indices`` of the model: weights, optimizer, staleness gate."""

    def __init__(
        self,
        *,
        index: int,
        indices: range,
        window: int,
        incarnation: int,
        weights: list[torch.Tensor],
        optimizer_factory: Any,
        optimizer_state: dict[int, dict[str, Any]],
        policy: Any,
        replicas: int,
        timeout_s: float,
    ) -> None:
        self.index, self.indices, self.window = index, indices, window
        self.incarnation = incarnation  # the fit's rollbacks when it was built
        self.policy, self.replicas, self.timeout_s = policy, replicas, timeout_s
        self.params = [torch.nn.Parameter(w.detach().to("cpu", copy=True)) for w in weights]
        self.sizes = [p.numel() for p in self.params]
        self.optimizer = optimizer_factory(self.params)
        for k, param in zip(indices, self.params, strict=True):
            if k in optimizer_state:
                self.optimizer.state[param] = _clone(optimizer_state[k])
        self.initial_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.gate = StalenessGate(replicas, policy.staleness, overlap=policy.overlap)
        self.start = self.flat_weights()  # θ at the window's start: what everyone pulled
        self.pulled_weights = dict.fromkeys(range(replicas), self.start)  # for DC-ASGD
        self.replied_weights = dict.fromkeys(range(replicas), self.start)  # (overlap)
        self.pushes: dict[int, Push] = {}
        self.replies: dict[int, dict[str, Any]] = {}
        self.finals: dict[int, dict[str, Any]] = {}  # by window: what finishers take
        self.error: str | None = None
        self.changed = asyncio.Condition()

    # -- the replicas' calls (on the event loop) ----------------------------------------
    async def push(self, replica: int, push: Push) -> dict[str, Any]:
        async with self.changed:
            self._check()
            self.gate.push(replica)
            self.pushes[replica] = push
            self._apply_ready()
            await self._wait_for(lambda: replica in self.replies)
            return self.replies.pop(replica)

    async def finish(self, replica: int, window: int, stop: int) -> dict[str, Any]:
        """``replica`` ended window ``window``; waits for all, then everyone takes the
        final weights and optimizer state, and the shard serves window ``stop``."""
        async with self.changed:
            self._check()
            self.gate.finish(replica)
            self._apply_ready()
            if self.gate.all_finished:
                # (the previous window's finishers have all returned: none can be left)
                self.finals = {window: self._final()}
                self.window = stop
                self.gate = StalenessGate(
                    self.replicas,
                    self.policy.staleness,
                    self.gate.version,
                    overlap=self.policy.overlap,
                )
                self.start = self.finals[window]["weights"]
                self.pulled_weights = dict.fromkeys(range(self.replicas), self.start)
                self.replied_weights = dict.fromkeys(range(self.replicas), self.start)
                self.changed.notify_all()
            await self._wait_for(lambda: window in self.finals)
            return self.finals[window]

    async def fail(self, reason: str) -> None:
        async with self.changed:
            self.error = self.error or reason
            self.changed.notify_all()

    # -- inside ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise ShardError(self.error)

    async def _wait_for(self, ready: Any) -> None:
        try:
            await asyncio.wait_for(
                self.changed.wait_for(lambda: ready() or self.error is not None),
                self.timeout_s,
            )
        except TimeoutError:
            self.error = (
                f"parameter-store shard {self.index} waited {self.timeout_s:g} s for the "
                f"other replicas (in flight: {self.gate.pulled}, pending: {self.gate.pending})"
                "; a replica is lost or stuck (raise collective_timeout_s if steps are slow)"
            )
            self.changed.notify_all()
        if not ready():
            self._check()

    def _apply_ready(self) -> None:
        applied = False
        while self.gate.may_apply():
            self._apply(self.gate.apply())
            applied = True
        if applied:
            self.changed.notify_all()

    @torch.no_grad()
    def _apply(self, staleness: dict[int, int]) -> None:
        pushes = {r: self.pushes.pop(r) for r in staleness}
        now = self.flat_weights() if self.policy.delay_compensation else None
        total: torch.Tensor | None = None
        for replica, push in pushes.items():
            if not push.finite:
                continue  # refused: it would poison every replica's weights
            factor = push.weight * self.policy.lr_factor(staleness[replica], self.replicas)
            grad = push.grad
            if now is not None and staleness[replica]:  # DC-ASGD
                lam = self.policy.delay_compensation
                grad = grad + lam * grad * grad * (now - self.pulled_weights[replica])
            total = grad * factor if total is None else total.add_(grad, alpha=factor)
        if total is not None:
            self._set_lrs(list(pushes.values()))
            for param, part in zip(self.params, total.split(self.sizes), strict=True):
                param.grad = part.view_as(param)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        version = self.gate.version
        weights = self.flat_weights()
        for replica, push in pushes.items():
            if self.policy.overlap:  # the next gradient is on the previous reply's weights
                self.pulled_weights[replica] = self.replied_weights[replica]
                self.replied_weights[replica] = weights
            else:
                self.pulled_weights[replica] = weights
            self.replies[replica] = {
                "version": version,
                "staleness": staleness[replica],
                "weights": weights,
                "refused": not push.finite,
            }

    def _set_lrs(self, pushes: list[Push]) -> None:
        groups = self.optimizer.param_groups
        same = all(p.lrs == pushes[0].lrs for p in pushes)
        if same and len(pushes[0].lrs) == len(groups):
            lrs = pushes[0].lrs
        else:  # replicas at different LR-ramp steps, or other groups: the mean ratio
            total = sum(p.weight for p in pushes) or 1.0
            ratio = sum(p.weight * p.lr_ratio for p in pushes) / total
            lrs = [lr * ratio for lr in self.initial_lrs]
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr

    def flat_weights(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _final(self) -> dict[str, Any]:
        state = {
            k: _clone(self.optimizer.state[p])
            for k, p in zip(self.indices, self.params, strict=True)
            if p in self.optimizer.state
        }
        return {"weights": self.flat_weights(), "optimizer": state, "version": self.gate.version}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value
