"""One parameter-store shard: a share of the weights and their optimizer, on a worker.

It lives in the host worker's plugin and runs on the registry's store loop (handlers
of :mod:`dataflow.ps.service`), so a push that must wait for the staleness bound
awaits without holding a thread. Each version applies the pending pushes as one
optimizer step on ``Σ_r f(τ_r) (n_r / B) g_r``, ``f`` the policy's staleness factor.

A window ends at a barrier (``finish``). When a replica was lost in it (``drop``), the
shard knows which parts of the window's steps it applied (each push names its step
and owner): the barrier then answers with the parts still missing, the survivors
train them (a *retrain round*) and finish again, so the lost replica costs only the
gradient it had in flight. The barrier also averages the replicas' BatchNorm buffers
(shard 0), weighted by the samples each trained, over the replicas that finished.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.ps.gate import StalenessGate
from dataflow.stages.averaging import WeightAverage


@dataclass
class Push:
    grad: torch.Tensor  # this shard's part of the replica's local mean gradient (flat)
    weight: float  # the replica's share of the global batch, n_r / B
    lrs: list[float]  # the replica's LR per param group at this step
    lr_ratio: float  # the same as a ratio to the optimizer's initial LR (group 0)
    finite: bool
    part: tuple[int, int] | None = None  # (step, owner): which part of which step


class ShardError(RuntimeError):
    """The shard failed (aborted by a replica's error, or timed out waiting)."""


class WaitingShard:
    """What every shard's calls share: they wait on ``changed`` for the other replicas,
    and fail with the shard's ``error`` (a replica's failure, or ``timeout_s`` passed)."""

    changed: asyncio.Condition
    error: str | None
    timeout_s: float
    replicas: int
    dropped: set[int]
    # by step: the held-out sums each replica handed in at that evaluation
    held_out: dict[int, dict[int, dict[str, float]]]

    async def fail(self, reason: str) -> None:
        async with self.changed:
            self.error = self.error or reason
            self.changed.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise ShardError(self.error)

    def _timed_out(self) -> str:
        """The error a wait that timed out leaves: who was waited for."""
        raise NotImplementedError

    async def _wait_for(self, ready: Any, timed_out: Any = None) -> None:
        try:
            await asyncio.wait_for(
                self.changed.wait_for(lambda: ready() or self.error is not None),
                self.timeout_s,
            )
        except TimeoutError:
            self.error = (timed_out or self._timed_out)()
            self.changed.notify_all()
        if not ready():
            self._check()

    # -- the held-out evaluation's sums (shard 0) ----------------------------------------
    async def sum_held_out(self, replica: int, step: int, sums: dict[str, float]) -> dict:
        """``replica`` scored its share of the held-out set at step ``step``'s window end
        (the shared weights): hand in its sums and wait until every replica not dropped
        did; returns every sum handed in, by replica. A replica lost after it handed in
        still counts: its result may never reach the driver, but every survivor's now
        holds its share. The shares nobody handed in (replicas dropped before) the
        survivors score themselves."""
        dropped: set[int] = self.dropped  # (both kinds of shard keep the lost replicas)
        async with self.changed:
            self._check()
            if replica in dropped:
                raise ShardError(f"replica {replica} handed in scores after it was dropped")
            handed = self.held_out.setdefault(step, {})
            handed[replica] = dict(sums)
            for old in sorted(self.held_out)[:-2]:  # a slow reader may still read the last
                del self.held_out[old]
            self.changed.notify_all()

            def everyone() -> bool:
                return set(range(self.replicas)) - dropped <= set(handed)

            def timed_out() -> str:
                waiting = sorted(set(range(self.replicas)) - dropped - set(handed))
                return (
                    f"the held-out evaluation at step {step} waited {self.timeout_s:g} s for "
                    f"replicas {waiting} to hand in their scores; a replica is lost or stuck "
                    "(raise collective_timeout_s if the evaluation is long)"
                )

            await self._wait_for(everyone, timed_out)
            return {"sums": dict(handed)}


class ParameterShard(WaitingShard):
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
        ema: tuple[float | None, bool] = (None, False),
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
        # ema_decay: the weights' moving average, moved at each applied version (in the
        # optimizer's state, which the replicas take back at the window's end)
        decay, warmup = ema  # (ema_decay, ema_warmup)
        self.average = None if decay is None else WeightAverage(decay, warmup)
        self.gate = StalenessGate(replicas, policy.staleness, overlap=policy.overlap)
        self.start = self.flat_weights()  # θ at the window's start: what everyone pulled
        self.pulled_weights = dict.fromkeys(range(replicas), self.start)  # for DC-ASGD
        self.replied_weights = dict.fromkeys(range(replicas), self.start)  # (overlap)
        self.pushes: dict[int, Push] = {}
        self.last_update: torch.Tensor | None = None  # the last version's Δθ (lookahead)
        self.momentum = _momentum(self.optimizer)
        self.replies: dict[int, dict[str, Any]] = {}
        # by (window, round): what the finishers of that barrier take
        self.finals: dict[tuple[int, int], dict[str, Any]] = {}
        self.dropped: set[int] = set()  # replicas lost (for good: the fit regroups)
        self.held_out = {}
        self._new_window()
        self.error: str | None = None
        self.changed = asyncio.Condition()

    # -- the replicas' calls (on the event loop) ----------------------------------------
    async def push(self, replica: int, push: Push) -> dict[str, Any]:
        async with self.changed:
            self._check()
            if replica in self.dropped:
                raise ShardError(f"replica {replica} pushed after it was dropped as lost")
            self.gate.push(replica)
            self.pushes[replica] = push
            self._apply_ready()
            await self._wait_for(lambda: replica in self.replies)
            return self.replies.pop(replica)

    async def finish(
        self,
        replica: int,
        window: int,
        stop: int,
        *,
        round: int = 0,
        planned: Any = None,
        buffers: torch.Tensor | None = None,
        share: float = 0.0,
    ) -> dict[str, Any]:
        """``replica`` ended round ``round`` of window ``window``; waits for all, then
        everyone takes the final weights and optimizer state (and the shard serves
        window ``stop``), or, after a loss, the parts left to retrain. ``planned``: the
        window's (step, owner) parts; ``buffers``: the replica's buffers (float64), its
        samples' ``share`` of the window weighting them in the average."""
        async with self.changed:
            self._check()
            if replica in self.dropped:
                raise ShardError(f"replica {replica} finished after it was dropped as lost")
            self.gate.finish(replica)
            self.stop = stop
            if planned is not None:
                self.planned = {(int(step), int(owner)) for step, owner in planned}
            if buffers is not None:
                self.buffers[replica] = (float(share), buffers)
            self._apply_ready()
            self._settle()
            await self._wait_for(lambda: (window, round) in self.finals)
            return self.finals[(window, round)]

    async def drop(self, replicas: Any) -> None:
        """The replicas' workers are lost: their pushes applied stay, their gradients in
        flight are gone, nobody waits for them (a barrier they held settles now)."""
        async with self.changed:
            for replica in sorted(set(replicas) - self.dropped):
                self.dropped.add(replica)
                self.gate.drop(replica)
                self.buffers.pop(replica, None)
            self._apply_ready()
            self._settle()
            self.changed.notify_all()

    # -- inside ---------------------------------------------------------------------------
    def _new_window(self) -> None:
        self.round = 0  # retrain rounds of this window so far
        self.stop: int | None = None  # the next window's first step (from the finishers)
        self.applied_parts: set[tuple[int, int]] = set()
        self.planned: set[tuple[int, int]] | None = None
        self.buffers: dict[int, tuple[float, torch.Tensor]] = {}

    def _settle(self) -> None:
        """At the barrier (every replica finished or dropped, every push applied): the
        window's final state, or, when a dropped replica left parts unapplied, a
        retrain round of them on the current weights."""
        if not self.gate.all_finished or self.gate.pending or self.stop is None:
            return
        # (the previous barrier's finishers have all returned: none can be left)
        key, version = (self.window, self.round), self.gate.version
        missing = self.planned - self.applied_parts if self.dropped and self.planned else set()
        weights = self.flat_weights()
        if missing:
            self.finals = {
                key: {
                    "weights": weights,
                    "version": version,
                    "retrain": sorted(missing),
                    "dropped": sorted(self.dropped),
                }
            }
            self.round += 1
        else:
            self.finals = {key: {**self._final(), "dropped": sorted(self.dropped)}}
            self.window = self.stop
            self._new_window()
        self.gate = self.gate.renewed()
        self.start = weights
        self.pulled_weights = dict.fromkeys(range(self.replicas), self.start)
        self.replied_weights = dict.fromkeys(range(self.replicas), self.start)
        self.changed.notify_all()

    def _timed_out(self) -> str:
        return (
            f"parameter-store shard {self.index} waited {self.timeout_s:g} s for the "
            f"other replicas (in flight: {self.gate.pulled}, pending: {self.gate.pending})"
            "; a replica is lost or stuck (raise collective_timeout_s if steps are slow)"
        )

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
        self.applied_parts.update(p.part for p in pushes.values() if p.part is not None)
        lookahead = self.policy.lookahead
        now = self.flat_weights() if self.policy.delay_compensation or lookahead else None
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
            if self.average is not None:
                self.average.update_(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        version = self.gate.version
        weights = self.flat_weights()
        if lookahead and now is not None:
            self.last_update = weights - now
        for replica, push in pushes.items():
            sent = self._ahead(weights, staleness[replica]) if lookahead else weights
            if self.policy.overlap:  # the next gradient is on the previous reply's weights
                self.pulled_weights[replica] = self.replied_weights[replica]
                self.replied_weights[replica] = sent
            else:
                self.pulled_weights[replica] = sent
            self.replies[replica] = {
                "version": version,
                "staleness": staleness[replica],
                "weights": sent,
                "refused": not push.finite,
            }

    def _ahead(self, weights: torch.Tensor, staleness: int) -> torch.Tensor:
        """The weights ``staleness`` versions on if every version repeated the last
        update decayed by the momentum: ``θ + Δ Σ_{k=1..τ} μ^k`` (``Async(lookahead=True)``)."""
        mu = self.momentum
        if self.last_update is None or not staleness or not mu:
            return weights
        reach = sum(mu**k for k in range(1, staleness + 1))
        return weights + self.last_update * reach

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
        return {
            "weights": self.flat_weights(),
            "optimizer": state,
            "version": self.gate.version,
            "buffers": self._average_buffers(),
        }

    def _average_buffers(self) -> torch.Tensor | None:
        """The finishers' buffers weighted by their shares, in replica order (the same
        bits on every replica); over the replicas that finished, if one was lost."""
        if not self.buffers:
            return None
        total = sum(share for share, _ in self.buffers.values())
        average: torch.Tensor | None = None
        for replica in sorted(self.buffers):
            share, values = self.buffers[replica]
            weight = share / total if total else 1.0 / len(self.buffers)
            part = values.to(torch.float64) * weight
            average = part if average is None else average.add_(part)
        return average


def _momentum(optimizer: torch.optim.Optimizer) -> float:
    """The optimizer's momentum: SGD's ``momentum``, Adam's ``β₁``; 0 without one."""
    group = optimizer.param_groups[0]
    if "betas" in group:
        return float(group["betas"][0])
    return float(group.get("momentum", 0.0) or 0.0)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value
