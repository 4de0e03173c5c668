"""A replica's side of the fit's parameter store (``Async``; ``Local`` without a spatial
layout): its client, attached after setup and every regroup, and the window's barrier
there, with the retrain rounds a replica lost in the window leaves. A mixin of
:class:`~dataflow.runtime.replica.ReplicaRuntime` (its ``spec``, ``context``, ``steps``,
``stages``, ``generation`` and ``_train``).
"""

from __future__ import annotations

from typing import Any

from dataflow.runtime.window_parts import WindowTally, update_config


class StoreSide:
    """The replica's parameter-store calls."""

    spec: Any
    context: Any
    steps: Any
    stages: Any
    generation: int
    _train: Any

    def attach_store(self, worker: Any, registry: Any) -> None:
        """Asynchronous updates, and local updates without a spatial layout: a client of
        the fit's parameter store for this replica (none with a single replica), after
        setup and after every regroup; shards this worker hosted for an earlier group
        are dropped (rebuilt from the commit). Local updates average there, so a lost
        replica does not break the period (``dataflow/ps/average.py``)."""
        ctx = self.context
        averaging = self.spec.local is not None and ctx.spatial is None
        policy = self.spec.asynchronous or (self.spec.local if averaging else None)
        if policy is None:
            return
        if ctx.parameter_store is not None:
            ctx.parameter_store.close()
        ctx.parameter_store = None
        if ctx.collective is None:
            return
        from dataflow.ps.client import StoreClient

        update = update_config(self.stages.values())
        ctx.parameter_store = StoreClient(
            run_id=f"{self.spec.run_id}/g{self.generation}",
            policy=policy,
            rank=ctx.rank,
            replicas=ctx.world_size,
            model=ctx.model,
            optimizer=ctx.optimizer,
            optimizer_factory=update.optimizer,
            ema=(getattr(update, "ema_decay", None), getattr(update, "ema_warmup", False)),
            worker=worker,
            registry=registry,
            store=ctx.collective.store,
            prefix=f"dataflow-ps/{self.spec.run_id}/g{self.generation}",
            timeout_s=self.spec.collective_timeout_s,
            averaging=averaging,
        )

    def _settle_with_store(
        self, store: Any, tally: WindowTally, stage_seconds: dict, stop_step: int
    ) -> None:
        """The window's barrier at the parameter store. A replica lost in the window left
        parts the store never applied: they come back as retrain rounds, shared out over
        the survivors, until every part of every step is applied once. Then the store's
        weights, optimizer state and averaged buffers are this replica's."""
        first = tally.first
        planned = self._planned_parts(first, stop_step)
        total = sum(self.steps[i].global_batch for i in range(first, stop_step))
        while True:
            share = sum(tally.samples) / total if total else 0.0
            retrain = store.finish(stop_step, planned, share)
            if not retrain:
                break
            self._retrain(retrain, tally, stage_seconds)

    def _planned_parts(self, first: int, stop: int) -> list[tuple[int, int]]:
        """The window's (step, owner) parts: every replica's non-empty local batch."""
        return [
            (i, r)
            for i in range(first, stop)
            for r, size in enumerate(self.steps[i].local_batches)
            if size > 0
        ]

    def _retrain(self, parts: Any, tally: WindowTally, stage_seconds: dict) -> None:
        """Train (step, owner) parts of this window again: a lost replica's, which the
        store never received."""
        for index, part in parts:
            self._train(index, part, tally, stage_seconds)
            tally.retrained.append((index, part))
