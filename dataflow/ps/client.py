"""A replica's handle on the parameter store (``ReplicaContext.parameter_store``).

Called from the replica's task thread, which writes each call to every shard host at
once over the data plane (:mod:`dataflow.ps.plane`, a socket per host kept open for
the fit) and reads the replies, or, for the shard its own worker hosts, runs it on the
registry's store loop. Replica ``k < servers`` hosts shard ``k``: at a window's start it
(re)builds its shard from its own state when the shard does not serve that window (the fit's
start, a rollback, a regroup, a resume), which is how a lost server role comes back
from the last commit. With ``averaging`` (local updates) there is one shard, on replica
0, and it holds no weights: it averages what the replicas hand in at a period's end
(:mod:`dataflow.ps.average`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from typing import Any

import torch
from distributed.comm import get_address_host

from dataflow.ps.average import AverageShard
from dataflow.ps.plane import PlaneConnection
from dataflow.ps.shard import ParameterShard, ShardError
from dataflow.ps.shard_layout import shard_ranges


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
        averaging: bool = False,
        ema: tuple[float | None, bool] = (None, False),
    ) -> None:
        self.run_id, self.policy, self.rank, self.replicas = run_id, policy, rank, replicas
        self.averaging, self.ema = averaging, ema
        self.model, self.optimizer, self.factory = model, optimizer, optimizer_factory
        self.worker, self.registry, self.timeout_s = worker, registry, timeout_s
        self.params = list(model.parameters())
        # one shard per replica at most (shard k lives on replica k's worker): fewer when
        # a lost worker left fewer replicas than policy.servers
        self.servers = 1 if averaging else min(policy.servers, replicas)
        self.ranges = shard_ranges([p.numel() for p in self.params], self.servers)
        self.initial_lr = optimizer.param_groups[0]["lr"]
        self.store, self.prefix = store, prefix
        # each shard host's Dask address ("worker"), data-plane address and token
        self.planes: list[dict[str, str]] | None = None
        self.connections: dict[int, PlaneConnection] = {}
        self.window: int | None = None
        # rollbacks in this process group, counted alike on every replica: a shard built
        # after the n-th serves incarnation n, and calls of an aborted window fail fast
        self.incarnation = 0
        self.applied: list[int] = []
        self.outstanding: dict[int, Any] | None = None  # overlap: the push in flight
        self.round = 0  # retrain rounds of this window (a replica was lost in it)
        self.targets: dict[tuple[int, int], list[int]] = {}  # part -> shards lacking it
        self.dropped: list[int] = []  # replicas the store was told are lost
        self.first_bad: dict[int, int] = {}  # local updates: each replica's, last average
        if rank < self.servers:  # where the other replicas find this shard
            plane = registry.plane(get_address_host(worker.address))
            where = {"worker": worker.address, "plane": plane.address, "token": plane.token}
            store.set(f"{prefix}/ps/{rank}", json.dumps(where))

    # -- windows ------------------------------------------------------------------------
    def begin_window(self, first_step: int) -> None:
        """Host: make sure the shard serves this window, else rebuild it from this
        replica's state (which is the commit the window starts from)."""
        self.window = first_step
        self.applied: list[int] = []  # the staleness of each push applied in this window
        self._abandon_outstanding()  # an overlapped push a failed window left
        self.round, self.targets = 0, {}
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
            if self.averaging:
                averages = AverageShard(
                    window=first_step,
                    incarnation=self.incarnation,
                    replicas=self.replicas,
                    timeout_s=self.timeout_s,
                )
                await self.registry.install(self.run_id, averages)
                return
            shard = ParameterShard(
                index=self.rank,
                indices=indices,
                window=first_step,
                incarnation=self.incarnation,
                weights=[self.params[k] for k in indices],
                optimizer_factory=self.factory,
                optimizer_state=state,
                ema=self.ema,
                policy=self.policy,
                replicas=self.replicas,
                timeout_s=self.timeout_s,
            )
            await self.registry.install(self.run_id, shard)

        self.registry.store.submit(install()).result()

    def push(self, weight: float, part: tuple[int, int] | None = None) -> dict[str, Any]:
        """Send this step's local mean gradient (weighted ``n_r / B``) of ``part`` (step,
        owner) to every shard (in a retrain round: to the shards that lack the part) and
        take the weights it produced. Returns whether a shard refused it (not finite),
        whether this push is finite (the shards refuse it if not) and the seconds waited.
        With ``overlap`` it sends and returns at once; the reply is taken at the next
        push (or the window's end), so the next step computes on the weights of the reply
        before, and a refusal is reported one step late (``finite`` at once)."""
        started = time.perf_counter()
        shards = self.targets.get(part, range(len(self.ranges)))
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        parts = []
        finite = True
        for k in shards:
            flat = torch.cat([grads[i].detach().reshape(-1) for i in self.ranges[k]]).to("cpu")
            parts.append(flat)
            finite = finite and bool(torch.isfinite(flat).all())
        messages = {
            k: dict(
                op_name="push",
                grad=flat,
                weight=float(weight),
                lrs=lrs,
                lr_ratio=lrs[0] / self.initial_lr if self.initial_lr else 1.0,
                finite=finite,
                replica=self.rank,
                part=None if part is None else list(part),
            )
            for k, flat in zip(shards, parts, strict=True)
        }
        if self.policy.overlap:
            refused = self._collect()  # the previous push's reply, before this one goes
            self.outstanding = self._start(messages)
        else:
            refused = self._take(self._wait(self._start(messages)))
        return {"refused": refused, "finite": finite, "waited_s": time.perf_counter() - started}

    def _collect(self) -> bool:
        """Overlap: wait for the push in flight, if any, and take its weights."""
        outstanding, self.outstanding = self.outstanding, None
        return False if outstanding is None else self._take(self._wait(outstanding))

    def _take(self, replies: dict[int, dict[str, Any]]) -> bool:
        """Load the weights a push produced; note the staleness it was applied at (the
        most over shards). Returns whether a shard refused it."""
        with torch.no_grad():
            for k, reply in replies.items():
                self._load_weights(self.ranges[k], reply["weights"])
        self.applied.append(max(r["staleness"] for r in replies.values()))
        return any(r["refused"] for r in replies.values())

    def finish(
        self, stop: int, planned: list[tuple[int, int]], share: float
    ) -> list[tuple[int, int]]:
        """This replica's window (or retrain round) is over: wait for all. Then either
        take the store's weights and optimizer state (identical on every replica) and
        the averaged buffers, and return ``[]``; or, a replica having been lost
        in the window, take the current weights and return the (step, owner) parts this
        replica trains again before it finishes once more (never an empty list: a
        replica with none of them finishes the next round at once). ``planned``: the window's
        parts; ``share``: this replica's samples over the window's."""
        self._collect()
        buffers = self._buffers()
        messages = {
            k: dict(
                op_name="finish",
                replica=self.rank,
                stop=stop,
                round=self.round,
                planned=[list(p) for p in planned],
                buffers=buffers if k == 0 else None,
                share=float(share),
            )
            for k in range(len(self.ranges))
        }
        replies = self._wait(self._start(messages))
        with torch.no_grad():
            for k, reply in replies.items():
                self._load_weights(self.ranges[k], reply["weights"])
        self.dropped = sorted({r for reply in replies.values() for r in reply["dropped"]})
        lacking: dict[tuple[int, int], list[int]] = {}
        for k, reply in replies.items():
            for step, owner in reply.get("retrain", ()):
                lacking.setdefault((int(step), int(owner)), []).append(k)
        if lacking:
            self.round += 1
            mine = self._my_share(sorted(lacking))
            self.targets = {p: lacking[p] for p in mine}
            if mine:
                return mine
            # None of the parts is this replica's, but the round's barrier waits for it
            # too: an empty list would read as "settled" and leave the others waiting
            # (collective_timeout_s), then the window failed.
            return self.finish(stop, planned, share)
        with torch.no_grad():
            for reply in replies.values():
                for i, state in reply["optimizer"].items():
                    param = self.params[int(i)]
                    self.optimizer.state[param] = _to(state, param.device)
            if replies[0].get("buffers") is not None:
                self._load_buffers(replies[0]["buffers"])
        self.window, self.round, self.targets = stop, 0, {}
        return []

    def average(
        self,
        stop: int,
        planned: list[tuple[int, int]],
        hand_in: Any,
        retrain: Any,
    ) -> dict[str, Any]:
        """Local updates: the period is over; hand in this replica's state (``hand_in()``:
        its ``parts``, ``samples``, flat float64 ``state`` whose first ``parameters``
        elements are the parameters, and ``first_bad`` step) and wait for all.
        When a replica was lost in the window, train this replica's share of its parts
        (``retrain(parts)``) and hand in again, until the store answers with the
        sample-weighted average (``"average"``, flat float64), the replicas' ``drift``
        and every replica's ``first_bad`` step."""
        while True:
            entry = hand_in()
            message = dict(
                op_name="average",
                replica=self.rank,
                stop=stop,
                round=self.round,
                planned=[list(p) for p in planned],
                parts=[list(p) for p in sorted(entry["parts"])],
                samples=int(entry["samples"]),
                state=entry["state"],
                parameters=int(entry["parameters"]),
                first_bad=entry["first_bad"],
            )
            reply = self._wait(self._start({0: message}))[0]
            self.dropped = sorted(int(r) for r in reply["dropped"])
            if "retrain" not in reply:
                self.window, self.round = stop, 0
                self.first_bad = {int(r): int(s) for r, s in reply["first_bad"].items()}
                return reply
            self.round += 1
            retrain(self._my_share([(int(s), int(o)) for s, o in reply["retrain"]]))

    def sum_held_out(self, step: int, sums: dict[str, float]) -> dict[int, dict[str, float]]:
        """Hand this replica's held-out sums of the evaluation at step ``step`` to shard 0
        and wait for every replica still in the fit: returns the sums handed in, by
        replica (the shares of replicas lost before they handed in are missing)."""
        message = dict(op_name="held_out", replica=self.rank, step=step, sums=dict(sums))
        reply = self._wait(self._start({0: message}))[0]
        return {int(r): dict(s) for r, s in reply["sums"].items()}

    def _my_share(self, items: list[Any]) -> list[Any]:
        """This replica's items of a list every survivor holds alike: the k-th goes to
        the k-th live replica, round the live ones."""
        live = [r for r in range(self.replicas) if r not in self.dropped]
        return [item for i, item in enumerate(items) if live[i % len(live)] == self.rank]

    def rolled_back(self) -> None:
        """Every replica rolled back: calls of the aborted window are refused from now."""
        self._abandon_outstanding()
        self.incarnation += 1
        if self.rank < self.servers:
            self.registry.discard(self.run_id, oldest=self.incarnation)

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()
        self.connections = {}
        if self.rank < self.servers:
            self.registry.discard(self.run_id, oldest=self.incarnation + 1)

    def abort(self, reason: str) -> None:
        """Fail every shard's waiting calls (a replica failed: the others must not wait
        for it until the timeout). Best effort, without blocking."""
        if self.planes is None:  # no call made yet: nothing waits
            return
        hosts = self._hosts()

        async def fail_all() -> None:
            for k, address in enumerate(hosts):
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
        """Each shard host's Dask address (read once from the rendezvous store)."""
        if self.planes is None:
            keys = [f"{self.prefix}/ps/{k}" for k in range(len(self.ranges))]
            self.planes = [json.loads(self.store.get(key).decode()) for key in keys]
        return [where["worker"] for where in self.planes]

    def _connection(self, k: int) -> PlaneConnection:
        if k not in self.connections:
            where = (self.planes or [])[k]
            self.connections[k] = PlaneConnection(where["plane"], where["token"], self.timeout_s)
        return self.connections[k]

    def _start(self, messages: dict[int, dict[str, Any]]) -> dict[int, Any]:
        """Send one message to each shard named: written to its host's connection now,
        or, for a shard this worker hosts, run on the store loop (no socket, no copy).
        ``_wait`` takes the replies."""
        hosts = self._hosts()
        common = dict(
            run_id=self.run_id,
            window=self.window,
            incarnation=self.incarnation,
            timeout_s=self.timeout_s,
        )
        pending: dict[int, Any] = {}
        for k, message in messages.items():
            if hosts[k] == self.worker.address:
                call = self.registry.handle(shard=k, **common, **message)
                pending[k] = self.registry.store.submit(call)
            else:
                connection = self._connection(k)
                connection.send({"shard": k, **common, **message})
                pending[k] = connection
        return pending

    def _wait(self, pending: dict[int, Any]) -> dict[int, dict[str, Any]]:
        replies: dict[int, dict[str, Any]] = {}
        try:
            for k, call in pending.items():
                if isinstance(call, concurrent.futures.Future):
                    replies[k] = call.result()
                else:
                    replies[k] = call.receive()
        except BaseException:
            self._drop_unread({k: c for k, c in pending.items() if k not in replies})
            raise
        for reply in replies.values():
            if reply.get("status") != "ok":
                raise ShardError(
                    f"parameter store, replica {self.rank}: {reply.get('message', reply)}"
                )
        return replies

    def _abandon_outstanding(self) -> None:
        """The overlapped push in flight will not be collected (its window failed)."""
        self._drop_unread(self.outstanding)
        self.outstanding = None

    def _drop_unread(self, pending: dict[int, Any] | None) -> None:
        """Close the connections whose reply will not be read (its window failed): a
        reply left in one would answer the next request. They reopen when next used."""
        for k, call in (pending or {}).items():
            if isinstance(call, PlaneConnection):
                call.close()
                if self.connections.get(k) is call:
                    del self.connections[k]

    def _buffers(self) -> torch.Tensor | None:
        """The buffers the store averages, as one float64 tensor: floating ones (BatchNorm
        statistics) and integer ones (``num_batches_tracked``: a replica that skipped a
        step counted one batch less; rounded back when loaded)."""
        kept = [b.detach().reshape(-1) for b in self.model.buffers() if not b.is_complex()]
        if not kept:
            return None
        return torch.cat([b.to("cpu", torch.float64) for b in kept])

    def _load_buffers(self, flat: torch.Tensor) -> None:
        offset = 0
        for buffer in self.model.buffers():
            if not buffer.is_complex():
                n = buffer.numel()
                value = flat[offset : offset + n].view_as(buffer)
                buffer.copy_(value if buffer.is_floating_point() else value.round())
                offset += n

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
