"""A replica's handle on the parameter store (``ReplicaContext.parameter_store``).

Called from the replica's task thread: each call runs on the worker's event loop
(``distributed.utils.sync``) and talks to the shards' hosts over Dask's RPC, all shards
at once. Replica ``k < servers`` hosts shard ``k``: at a window's start it (re)builds
its shard from its own state when the shard does not serve that window (the fit's
start, a rollback, a regroup, a resume), which is how a lost server role comes back
from the last commit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import torch
from distributed.protocol import to_serialize
from distributed.protocol.serialize import Serialize
from distributed.utils import sync

from dataflow.ps.layout import shard_ranges
from dataflow.ps.service import HANDLER
from dataflow.ps.shard import ParameterShard, ShardError


class StoreClient:
    def __init__(
        self,
        *,
        run_id: str,
        policy: Any,
        rank: int,
        replicas: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        optimizer_factory: Any,
        worker: Any,
        registry: Any,
        store: Any,
        prefix: str,
        timeout_s: float,
    ) -> None:
        self.run_id, self.policy, self.rank, self.replicas = run_id, policy, rank, replicas
        self.model, self.optimizer, self.factory = model, optimizer, optimizer_factory
        self.worker, self.registry, self.timeout_s = worker, registry, timeout_s
        self.params = list(model.parameters())
        # one shard per replica at most (shard k lives on replica k's worker): fewer when
        # a lost worker left fewer replicas than policy.servers
        self.servers = min(policy.servers, replicas)
        self.ranges = shard_ranges([p.numel() for p in self.params], self.servers)
        self.initial_lr = optimizer.param_groups[0]["lr"]
        self.store, self.prefix = store, prefix
        self.addresses: list[str] | None = None
        self.window: int | None = None
        # rollbacks in this process group, counted alike on every replica: a shard built
        # after the n-th serves incarnation n, and calls of an aborted window fail fast
        self.incarnation = 0
        self.applied: list[int] = []
        self.outstanding: concurrent.futures.Future | None = None
        if rank < self.servers:  # where the other replicas find this shard
            store.set(f"{prefix}/ps/{rank}", worker.address)

    # -- windows ------------------------------------------------------------------------
    def begin_window(self, first_step: int) -> None:
        """Host: make sure the shard serves this window, else rebuild it from this
        replica's state (which is the commit the window starts from)."""
        self.window = first_step
        self.applied: list[int] = []  # the staleness of each push applied in this window
        self.outstanding = None  # overlap: the push in flight
        if self.rank >= self.servers:
            return
        current = self.registry.shards.get((self.run_id, self.rank))
        if (
            current is not None
            and (current.window, current.incarnation) == (first_step, self.incarnation)
            and current.error is None
        ):
            return
        indices = self.ranges[self.rank]
        state = {
            k: self.optimizer.state[self.params[k]]
            for k in indices
            if self.params[k] in self.optimizer.state
        }

        async def install() -> None:
            shard = ParameterShard(
                index=self.rank,
                indices=indices,
                window=first_step,
                incarnation=self.incarnation,
                weights=[self.params[k] for k in indices],
                optimizer_factory=self.factory,
                optimizer_state=state,
                policy=self.policy,
                replicas=self.replicas,
                timeout_s=self.timeout_s,
            )
            await self.registry.install(self.run_id, shard)

        sync(self.worker.loop, install)

    def push(self, weight: float) -> dict[str, Any]:
        """Send this step's local mean gradient (weighted ``n_r / B``) to every shard and
        take the weights it produced. Returns whether a shard refused it (not finite) and
        the seconds waited. With ``overlap`` it sends and returns at once; the reply is
        taken at the next push (or the window's end), so the next step computes on the
        weights of the reply before, and a refusal is reported one step late."""
        started = time.perf_counter()
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        parts = []
        finite = True
        for indices in self.ranges:
            flat = torch.cat([grads[k].detach().reshape(-1) for k in indices]).to("cpu")
            parts.append(flat)
            finite = finite and bool(torch.isfinite(flat).all())
        messages = [
            dict(
                op_name="push",
                grad=flat,
                weight=float(weight),
                lrs=lrs,
                lr_ratio=lrs[0] / self.initial_lr if self.initial_lr else 1.0,
                finite=finite,
                replica=self.rank,
            )
            for flat in parts
        ]
        if self.policy.overlap:
            refused = self._collect()  # the previous push's reply, before this one goes
            self.outstanding = self._start(messages)
        else:
            refused = self._take(self._wait(self._start(messages)))
        return {"refused": refused, "waited_s": time.perf_counter() - started}

    def _collect(self) -> bool:
        """Overlap: wait for the push in flight, if any, and take its weights."""
        outstanding, self.outstanding = self.outstanding, None
        return False if outstanding is None else self._take(self._wait(outstanding))

    def _take(self, replies: list[dict[str, Any]]) -> bool:
        """Load the weights a push produced; note the staleness it was applied at (the
        most over shards). Returns whether a shard refused it."""
        with torch.no_grad():
            for indices, reply in zip(self.ranges, replies, strict=True):
                self._load_weights(indices, reply["weights"])
        self.applied.append(max(r["staleness"] for r in replies))
        return any(r["refused"] for r in replies)

    def finish(self, stop: int) -> int:
        """This replica's window is over: wait for all replicas, then take the store's
        weights and optimizer state (identical on every replica); returns the version."""
        self._collect()
        messages = [dict(op_name="finish", replica=self.rank, stop=stop) for _ in self.ranges]
        replies = self._wait(self._start(messages))
        with torch.no_grad():
            for indices, reply in zip(self.ranges, replies, strict=True):
                self._load_weights(indices, reply["weights"])
                for k, state in reply["optimizer"].items():
                    param = self.params[int(k)]
                    self.optimizer.state[param] = _to(state, param.device)
        self.window = stop
        return sum(r["version"] for r in replies)

    def rolled_back(self) -> None:
        """Every replica rolled back: calls of the aborted window are refused from now."""
        self.incarnation += 1
        if self.rank < self.servers:
            self.registry.discard(self.run_id, oldest=self.incarnation)

    def close(self) -> None:
        if self.rank < self.servers:
            self.registry.discard(self.run_id, oldest=self.incarnation + 1)

    def abort(self, reason: str) -> None:
        """Fail every shard's waiting calls (a replica failed: the others must not wait
        for it until the timeout). Best effort, without blocking."""
        if self.addresses is None:
            return

        async def fail_all() -> None:
            for k, address in enumerate(self.addresses or ()):
                try:
                    await asyncio.wait_for(
                        self.worker.rpc(address).dataflow_ps(
                            op_name="fail",
                            run_id=self.run_id,
                            shard=k,
                            reason=reason,
                            incarnation=self.incarnation,
                        ),
                        5,
                    )
                except Exception:  # the host may be the lost worker
                    pass

        self.worker.loop.add_callback(fail_all)

    # -- inside ---------------------------------------------------------------------------
    def _hosts(self) -> list[str]:
        if self.addresses is None:
            keys = [f"{self.prefix}/ps/{k}" for k in range(len(self.ranges))]
            self.addresses = [self.store.get(key).decode() for key in keys]
        return self.addresses

    def _start(self, messages: list[dict[str, Any]]) -> concurrent.futures.Future:
        """Send one message to each shard, on the worker's event loop; the future holds
        their replies."""
        hosts = self._hosts()
        common = dict(
            run_id=self.run_id,
            window=self.window,
            incarnation=self.incarnation,
            timeout_s=self.timeout_s,
        )
        here = self.worker.address

        async def call(k: int, address: str, message: dict[str, Any]) -> dict[str, Any]:
            if address == here:  # this worker hosts the shard: no socket, no serialization
                reply = await self.registry.handle(shard=k, **common, **message)
                return {key: v.data if isinstance(v, Serialize) else v for key, v in reply.items()}
            wrapped = {
                key: to_serialize(v) if isinstance(v, torch.Tensor) else v
                for key, v in message.items()
            }
            return await getattr(self.worker.rpc(address), HANDLER)(shard=k, **common, **wrapped)

        async def call_all() -> list[dict[str, Any]]:
            calls = [
                call(k, address, message)
                for k, (address, message) in enumerate(zip(hosts, messages, strict=True))
            ]
            return await asyncio.gather(*calls)

        return asyncio.run_coroutine_threadsafe(call_all(), self.worker.loop.asyncio_loop)

    def _wait(self, future: concurrent.futures.Future) -> list[dict[str, Any]]:
        replies = future.result()
        for reply in replies:
            if reply.get("status") != "ok":
                raise ShardError(
                    f"parameter store, replica {self.rank}: {reply.get('message', reply)}"
                )
        return replies

    def _load_weights(self, indices: range, flat: torch.Tensor) -> None:
        offset = 0
        for k in indices:
            param = self.params[k]
            n = param.numel()
            param.copy_(flat[offset : offset + n].view_as(param))
            offset += n
        if offset != flat.numel():
            raise ShardError(f"parameter store sent {flat.numel()} weights, expected {offset}")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        # optimizers keep some state on the host (Adam's step counter): keep it there
        return value.clone() if value.dim() == 0 else value.to(device, copy=True)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
