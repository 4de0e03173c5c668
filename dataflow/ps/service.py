"""The parameter store's side on its host worker: the shards of each fit, and the one
handler replicas call, over the data plane (:mod:`dataflow.ps.plane`: push, finish)
or Dask's RPC (``dataflow_ps``, control only: fail).

Shards live in the worker plugin (``plugin.ps``, by fit and shard index), never in
module globals, on the registry's own store loop (a thread of its own, not Dask's
event loop). A shard serves one window at a time; a push or finish for a window the
shard does not serve yet waits for the host to install it (after a rollback the host
rebuilds its shard from the commit it rolled back to).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from distributed.protocol import to_serialize

from dataflow.ps.average import HandedIn
from dataflow.ps.gate import StalenessError
from dataflow.ps.plane import PlaneServer, StoreLoop
from dataflow.ps.shard import ParameterShard, Push, ShardError

HANDLER = "dataflow_ps"


class ShardRegistry:
    """The shards a worker hosts, by (run id, shard index); lives in the plugin. Its
    store loop and plane server start with the first fit that uses them."""

    def __init__(self) -> None:
        self.shards: dict[tuple[str, int], ParameterShard] = {}
        self._store: StoreLoop | None = None
        self._plane: PlaneServer | None = None
        self._changed: asyncio.Condition | None = None
        # fit key -> the oldest incarnation still served: calls of an older one (a window
        # a rollback aborted) fail at once instead of waiting for a shard never to come
        self.oldest: dict[str, int] = {}
        # fit key -> replicas lost and released by the driver (kept for shards installed
        # later: a host may rebuild its shard after the driver's word arrived)
        self.dropped: dict[str, set[int]] = {}

    @property
    def store(self) -> StoreLoop:
        """The loop the shards live on and every call is served on."""
        if self._store is None:
            self._store = StoreLoop()
        return self._store

    def plane(self, host: str) -> PlaneServer:
        """This worker's data-plane server, listening on ``host``."""
        if self._plane is None:
            self._plane = PlaneServer(host, self.handle, self.store)
        return self._plane

    @property
    def plane_requests(self) -> int:
        """Calls served over this worker's data plane so far (its replicas' own shard
        calls do not cross it)."""
        return 0 if self._plane is None else self._plane.requests

    def close(self) -> None:
        if self._plane is not None:
            self._plane.close()
        if self._store is not None:
            self._store.close()
        self._plane = self._store = None

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # made on the event loop, where it is used
            self._changed = asyncio.Condition()
        return self._changed

    async def install(self, run_id: str, shard: ParameterShard) -> None:
        async with self.changed:
            old = self.shards.get((run_id, shard.index))
            if old is not None:
                await old.fail("replaced: the host rebuilt its shard from a commit")
            self.shards[(run_id, shard.index)] = shard
            if self.dropped.get(run_id):
                await shard.drop(self.dropped[run_id])
            self.changed.notify_all()

    def discard(self, run_id: str, oldest: int | None = None) -> None:
        """Forget ``run_id``'s shards, from any thread (a rollback, a regroup or the fit's
        end; the host rebuilds a shard at the next window it starts). ``oldest``: calls
        of earlier incarnations are refused from now on. The shards are dropped and
        their waiting calls failed on the store loop, which owns the registry."""
        if oldest is not None:
            self.oldest[run_id] = max(self.oldest.get(run_id, 0), oldest)

        async def forget() -> None:
            for key in [k for k in self.shards if k[0] == run_id]:
                await self.shards.pop(key).fail("dropped: its host rolled back or regrouped")
            await self.notify()

        if self._store is not None:  # (no loop yet: no shard either)
            self._store.submit(forget())

    async def drop(self, run_id: str, replicas: Any) -> None:
        """The driver released lost ``replicas`` of fit ``run_id``: the shards hosted here
        stop waiting for them (now, and when installed later)."""
        self.dropped.setdefault(run_id, set()).update(int(r) for r in replicas)
        for key in [k for k in self.shards if k[0] == run_id]:
            await self.shards[key].drop(self.dropped[run_id])

    async def serving(
        self, run_id: str, index: int, window: int, incarnation: int, timeout_s: float
    ) -> Any:
        """The shard once it serves ``window`` of ``incarnation`` (rollbacks so far)."""

        def stale() -> bool:
            return incarnation < self.oldest.get(run_id, 0)

        def ready() -> bool:
            shard = self.shards.get((run_id, index))
            return shard is not None and (shard.window, shard.incarnation) == (
                window,
                incarnation,
            )

        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: ready() or stale()), timeout_s)
                if stale():
                    raise ShardError(
                        f"parameter-store call of window {window} was rolled back (incarnation "
                        f"{incarnation}, the host serves {self.oldest.get(run_id)})"
                    )
            except TimeoutError:
                shard = self.shards.get((run_id, index))
                raise ShardError(
                    f"parameter-store shard {index} of fit {run_id} does not serve window "
                    f"{window} after {timeout_s:g} s (it serves "
                    f"{None if shard is None else shard.window}); its host replica is lost "
                    "or behind"
                ) from None
            return self.shards[(run_id, index)]

    async def handle_rpc(self, **msg: Any) -> dict[str, Any]:
        """The ``dataflow_ps`` Dask handler (control: a replica failing the shards), on
        Dask's event loop: served on the store loop, tensors wrapped for Dask's comm."""
        reply = await self.store.run(self.handle(**msg))
        return {k: to_serialize(v) if _bulky(v) else v for k, v in reply.items()}

    async def handle(self, **msg: Any) -> dict[str, Any]:
        """One call, on the store loop: ``op_name`` is push, finish, average, held_out
        or fail."""
        op, run_id, index = msg["op_name"], msg["run_id"], msg["shard"]
        try:
            if op == "fail":
                shard = self.shards.get((run_id, index))
                if shard is not None and shard.incarnation == msg["incarnation"]:
                    await shard.fail(msg["reason"])
                return {"status": "ok"}
            shard = await self.serving(
                run_id, index, msg["window"], msg["incarnation"], msg["timeout_s"]
            )
            if op == "push":
                push = Push(
                    grad=msg["grad"],
                    weight=msg["weight"],
                    lrs=list(msg["lrs"]),
                    lr_ratio=msg["lr_ratio"],
                    finite=msg["finite"],
                    part=None if msg.get("part") is None else tuple(msg["part"]),
                )
                return {**await shard.push(msg["replica"], push), "status": "ok"}
            if op == "finish":
                final = await shard.finish(
                    msg["replica"],
                    msg["window"],
                    msg["stop"],
                    round=msg.get("round", 0),
                    planned=msg.get("planned"),
                    buffers=msg.get("buffers"),
                    share=msg.get("share", 0.0),
                )
                await self.notify()  # pushes of the next window may wait on the registry
                return {"status": "ok", **final}
            if op == "average":
                entry = HandedIn(
                    parts=frozenset((int(s), int(o)) for s, o in msg["parts"]),
                    samples=int(msg["samples"]),
                    state=msg["state"],
                    parameters=int(msg["parameters"]),
                    first_bad=msg.get("first_bad"),
                )
                final = await shard.average(
                    msg["replica"], msg["window"], msg["stop"], msg["round"], msg["planned"], entry
                )
                await self.notify()
                return {"status": "ok", **final}
            if op == "held_out":
                summed = await shard.sum_held_out(msg["replica"], msg["step"], msg["sums"])
                return {"status": "ok", **summed}
            return {"status": "error", "message": f"unknown parameter-store op {op!r}"}
        except (ShardError, StalenessError) as exc:
            return {"status": "error", "message": str(exc)}

    async def notify(self) -> None:
        """Wake calls waiting for a shard (its window moved on)."""
        async with self.changed:
            self.changed.notify_all()


def _bulky(value: Any) -> bool:
    """Tensors and optimizer states travel as serialized frames, not msgpack."""
    return isinstance(value, torch.Tensor | dict)
