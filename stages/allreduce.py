"""AllReduce: the mean gradient of the global batch on every replica, overlapped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dataflow.errors import ConfigError
from dataflow.runtime.reducer import BucketReducer
from dataflow.stages.base import Gradients, ReplicaContext, Stage, StepContext


@dataclass(kw_only=True, frozen=True)
class AllReduceConfig:
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ConfigError(
                f"AllReduce(bucket_mb={self.bucket_mb}): the bucket size in MiB must be > 0 "
                "(25 is a good default; smaller starts communication earlier)"
            )


class AllReduce(Stage):
    """Buckets of ``bucket_mb`` MiB start reducing from backward hooks as they fill.

    At setup, rank 0's weights are broadcast so every replica starts identical.
    With one replica it does nothing.
    """

    def __init__(self, *, bucket_mb: float = 25.0, name: str | None = None) -> None:
        super().__init__(name)
        self.config = AllReduceConfig(bucket_mb=bucket_mb)

    def setup(self, replica: ReplicaContext) -> None:
        self._reducer = None
        if replica.world_size == 1:
            return
        if replica.model is None:
            raise ConfigError(f"{self.name}: needs a Forward stage upstream to build the model")
        state = list(replica.model.parameters()) + list(replica.model.buffers())
        replica.collective.broadcast([t.data for t in state], src=0)
        self._reducer = BucketReducer(
            list(replica.model.parameters()),
            replica.collective,
            cap_bytes=int(self.config.bucket_mb * 2**20),
        )

    def begin_step(self, step: StepContext) -> None:
        if self._reducer is not None:
            self._reducer.begin_step(step.weight)

    def run(self, step: StepContext, grads: Gradients) -> Gradients:
        if self._reducer is not None:
            self._reducer.finish()
        return Gradients(samples=grads.samples, reduced=True)

    def end_phase(self, replica: ReplicaContext) -> dict[str, Any]:
        """Average floating-point buffers (BatchNorm running statistics) over replicas.

        Each replica updates its running statistics from its own local batches, so
        they drift apart; the mean is the best estimate, and afterwards every replica
        (and the model returned to the driver) holds the same state.
        """
        if self._reducer is not None:
            buffers = [b for b in replica.model.buffers() if b.is_floating_point()]
            for buffer in buffers:
                replica.collective.allreduce(buffer.data).div_(replica.world_size)
        return {}

    def teardown(self, replica: ReplicaContext) -> None:
        if getattr(self, "_reducer", None) is not None:
            self._reducer.close()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
