"""Load: read this replica's share of each global batch, prefetched on a thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dataflow.core import kinds
from dataflow.core.errors import CollectiveError, ConfigError
from dataflow.core.protocols import Source, missing_members
from dataflow.io.batch_buffers import BatchBuffers
from dataflow.io.chunk_index import is_chunked
from dataflow.io.chunk_reader import (
    EpochChunkReader,
    auto_decode_threads,
    check_decode_threads,
)
from dataflow.io.device_copy import DATA_ON_DEVICE, device_copy
from dataflow.io.device_staging import CudaCopies, DeviceStager
from dataflow.io.labels import LabelCheck
from dataflow.io.prefetch import Prefetcher
from dataflow.io.sharding import (
    DEFAULT_BUFFER_CHUNKS,
    epoch_streams,
    replica_epochs,
    replica_streams,
    source_chunk_groups,
    source_chunk_members,
    source_chunk_sizes,
)
from dataflow.stages.base import Batch, PhaseContext, ReplicaContext, Stage, StepContext

# Output buffers kept beyond ``prefetch``: the batch being assembled, the one the step's
# stages (Transform, Forward, Backward) still hold, and the ones in hand between them.
BUFFER_SLACK = 4


@dataclass(kw_only=True, frozen=True)
class LoadConfig:
    prefetch: int = 2
    drop_last: bool = False
    buffer_chunks: int = DEFAULT_BUFFER_CHUNKS  # shuffle buffer, in chunks of the source
    # An in-memory source uploaded to the GPU once ("auto": when it fits in a quarter of
    # the free device memory; see io.device_copy)
    data_on_device: bool | str = "auto"
    # Threads decoding a chunked source's chunks ("auto": min(4, the replica's cores))
    decode_threads: int | str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.drop_last, bool):
            raise ConfigError(
                f"Load(drop_last={self.drop_last!r}): must be True or False (True drops an "
                "epoch's last batch when it is short)"
            )
        if not isinstance(self.buffer_chunks, int) or self.buffer_chunks < 1:
            raise ConfigError(
                f"Load(buffer_chunks={self.buffer_chunks!r}): the shuffle buffer mixes samples "
                "across this many chunks; it must be an int >= 1"
            )
        if self.data_on_device not in DATA_ON_DEVICE or not isinstance(
            self.data_on_device, bool | str
        ):
            raise ConfigError(
                f"data_on_device={self.data_on_device!r}: use 'auto' (an in-memory source that "
                "fits in a quarter of the GPU's free memory is uploaded once), True or False"
            )
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ConfigError(
                f"Load(prefetch={self.prefetch!r}): prefetch is the number of batches read "
                "ahead and must be an int >= 1"
            )
        check_decode_threads("Load", self.decode_threads)


class Load(Stage):
    """Reads this replica's share of each step from its epoch stream.

    The streams come from :func:`dataflow.io.replica_streams`: each replica reads
    whole chunks in a shuffled order, mixed by a shuffle buffer of ``buffer_chunks``
    chunks, ``prefetch`` batches ahead on a background thread. A chunked source
    (zarr, dask) is read through :class:`dataflow.io.EpochChunkReader`, which decodes
    each chunk once per epoch, the new chunks of each batch ahead of the assembly on
    ``decode_threads`` threads ("auto": min(4, the replica's cores: its torch threads,
    or on a GPU the host's cores per GPU)). The indices of every batch trained on are
    reported with each window's results, for the driver's sample ledger.

    Batches are assembled into output buffers that are reused (no fresh memory per
    batch), but only once nothing refers to a batch any more: stages downstream may
    keep a batch, or views of it, as long as they like
    (:class:`dataflow.io.batch_buffers.BatchBuffers`).
    On CUDA they are assembled straight into pinned memory from torch's caching host
    allocator, which reuses pinned blocks once the asynchronous copies reading them
    have finished, and copied to the device on a side stream, ``prefetch`` batches
    ahead; the compute stream waits on each batch's event (:mod:`dataflow.io.device_staging`).
    An in-memory source that fits on the GPU is uploaded once instead (``data_on_device``).
    """

    kind = kinds.LOAD

    def __init__(
        self,
        source: Any,
        *,
        prefetch: int = 2,
        drop_last: bool = False,
        buffer_chunks: int = DEFAULT_BUFFER_CHUNKS,
        data_on_device: bool | str = "auto",
        decode_threads: int | str = "auto",
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        if not isinstance(source, Source):
            raise ConfigError(
                f"Load(source=...): {type(source).__name__} has no "
                f"{missing_members(source, Source)[0]!r}; pass a dataflow.io source such as "
                "ArraySource(x, y), or an object with num_samples and read(indices)"
            )
        self.source = source
        self.config = LoadConfig(
            prefetch=prefetch,
            drop_last=drop_last,
            buffer_chunks=buffer_chunks,
            data_on_device=data_on_device,
            decode_threads=decode_threads,
        )
        # Set by the fit's dry run when the targets are class labels (dataflow.label_watch):
        # every batch's labels are checked on the host, before they go to the device.
        self.labels: LabelCheck | None = None

    def setup(self, replica: ReplicaContext) -> None:
        self._replica = replica
        if replica.spatial is not None:  # read only this worker's region of each sample
            self.source = replica.spatial.region_of(self.source)
        self._prefetcher: Prefetcher | None = None
        self._readers = []
        threads = self.config.decode_threads  # after the worker set torch's threads
        self._decode_threads = auto_decode_threads(replica.device) if threads == "auto" else threads
        self._buffers = BatchBuffers(
            keep=self.config.prefetch + BUFFER_SLACK, pin_memory=replica.device.type == "cuda"
        )
        # An in-memory source on the GPU: uploaded once, batches gathered there; its
        # labels are checked once here instead of batch by batch
        self._resident = device_copy(self.source, replica.device, self.config.data_on_device)
        replica.state["data_on_device"] = self._resident is not None
        cuda = replica.device.type == "cuda"
        self._stager = DeviceStager(CudaCopies(replica.device)) if cuda else None
        if self._resident is not None and self.labels is not None and self.source.y is not None:
            self.labels.check(self.source.y, np.arange(self.source.num_samples))

    def streams(self, steps: Any, seed: int) -> Any:
        """Every replica's sample indices per step of ``steps`` (pure; see io.sharding)."""
        return replica_streams(
            steps,
            sizes=source_chunk_sizes(self.source),
            members=source_chunk_members(self.source),
            groups=source_chunk_groups(self.source),
            seed=seed,
            shuffle=getattr(self.source, "shuffle", True),
            buffer_chunks=self.config.buffer_chunks,
        )

    def epoch_streams(self, steps: Any, seed: int) -> Any:
        """Per epoch of ``steps``: its steps and every replica's stream (pure; see
        io.sharding.epoch_streams). What the driver's ledger records from."""
        return epoch_streams(
            steps,
            sizes=source_chunk_sizes(self.source),
            members=source_chunk_members(self.source),
            groups=source_chunk_groups(self.source),
            seed=seed,
            shuffle=getattr(self.source, "shuffle", True),
            buffer_chunks=self.config.buffer_chunks,
        )

    def _batches(self, steps: Any, seed: int) -> Any:
        """(step index, batch) for this replica, epoch by epoch; runs on the loader thread."""
        rank = self._replica.rank
        epochs = replica_epochs(
            steps,
            sizes=source_chunk_sizes(self.source),
            members=source_chunk_members(self.source),
            groups=source_chunk_groups(self.source),
            seed=seed,
            shuffle=getattr(self.source, "shuffle", True),
            buffer_chunks=self.config.buffer_chunks,
        )
        # One epoch ahead (EpochChunkReader.then): a remote store's next epoch is fetched
        # while this one ends, and its first chunks decode once this one's are all
        # decoded, so neither its first GETs nor its first decodes are waited for
        mine_per_epoch = (
            (epoch_steps, [step_parts[rank] for step_parts in parts])
            for _, epoch_steps, parts in epochs
        )
        current = next(mine_per_epoch, None)
        reader = self._epoch_reader(current[1]) if current is not None else None
        after = None
        try:
            while current is not None:
                epoch_steps, mine = current
                following = next(mine_per_epoch, None)
                after = self._epoch_reader(following[1]) if following is not None else None
                if reader is not None:  # checks the epoch's chunks exist, then decodes once
                    reader.then = after
                    self._readers.append(reader)
                    batches = iter(reader)
                else:
                    source = self._reads_from
                    batches = (source.read(indices) for indices in mine)
                try:
                    for spec, batch in zip(epoch_steps, batches, strict=False):
                        batch.indices = mine[spec.index - epoch_steps[0].index]
                        yield spec.index, batch
                        del batch  # the consumer decides how long it lives (buffer reuse)
                finally:
                    close = getattr(batches, "close", None)
                    if close is not None:  # stops the reader's decode thread early
                        close()
                current, reader = following, after
        finally:  # an epoch started ahead and never read: its fetches and reads stop
            if after is not None:
                after.close_unread()

    def _epoch_reader(self, mine: list[np.ndarray]) -> EpochChunkReader | None:
        """The reader of an epoch of this replica's batches ``mine`` (a chunked source)."""
        if not is_chunked(self.source):
            return None
        return EpochChunkReader(
            self.source, mine, buffers=self._buffers, decode_threads=self._decode_threads
        )

    def _stage(self, item: Any) -> tuple[int, Batch]:
        """On CUDA: pinned host memory, then an asynchronous copy (on the loader thread)."""
        index, batch = item
        if self._resident is not None:  # on the device already, its labels checked
            return index, batch
        if self.labels is not None:  # a label the model has no class for names its sample
            self.labels.check(batch.y, batch.indices)
        if self._stager is not None:  # copied on a side stream, an event marks its end
            self._stager.stage(batch)
        return index, batch

    @property
    def _reads_from(self) -> Any:
        """The source batches are read from: its copy on the device, if it has one."""
        return self._resident if self._resident is not None else self.source

    def _read_part(self, step: StepContext) -> Batch:
        """Replica ``step.part``'s batch of ``step``, read now (not prefetched): the plan
        gives every replica's indices, so any replica can read any part."""
        if self._parts is None:
            self._parts = {spec.index: parts for spec, parts in self.streams(*self._phase)}
        indices = self._parts[step.spec.index][step.part]
        batch = self._reads_from.read(indices)
        batch.indices = indices
        return self._handed_over(self._stage((step.spec.index, batch))[1])

    def _handed_over(self, batch: Batch) -> Batch:
        """The batch, its copy to the device waited for on the compute stream."""
        return batch if self._stager is None else self._stager.hand_over(batch)

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None:
        self._phase, self._parts = (phase.steps, replica.seed), None
        self._close()
        self._readers: list[EpochChunkReader] = []
        self._prefetcher = Prefetcher(
            self._stage, self._batches(phase.steps, replica.seed), depth=self.config.prefetch
        )

    def run(self, step: StepContext, *inputs: Any) -> Batch:
        if step.part is not None:  # a slower replica's part, taken over (sample leases)
            batch = self._read_part(step)
            step.metrics["sample_indices"] = batch.indices
            return batch
        while True:
            index, batch = self._prefetcher.get()
            if index == step.spec.index:
                break
            # Under sample leases a peer may have taken over parts of this replica's: it
            # skips their batches. Anything else means the plan and the loader disagree.
            if not (self._replica.settles_at_window_end and index < step.spec.index):
                raise RuntimeError(
                    f"Load: expected step {step.spec.index}, loader produced {index}"
                )
        # The driver records them in its sample ledger when the window is committed.
        step.metrics["sample_indices"] = batch.indices
        return self._handed_over(batch)

    def interrupt(self, reason: str) -> None:
        """The window was aborted while this replica may wait for its batch (a store
        riding out an outage): the wait ends with an echo of the abort, not the cause."""
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:
            rank = getattr(getattr(self, "_replica", None), "rank", None)
            prefetcher.interrupt(
                CollectiveError(
                    f"replica {rank}: {reason} while it waited for its batch from the source"
                )
            )
        for reader in getattr(self, "_readers", ()):  # a read retrying a failing store
            reader.abandon()  # gives up now: nobody takes this phase's batches any more

    def _close(self) -> None:
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def end_phase(self, replica: ReplicaContext) -> dict[str, Any]:
        """Report the chunks decoded, the most samples held at once and the reads sent
        again to a store failing in a way that passes (``io.store_retry``) in the phase."""
        self._close()
        readers, self._readers = self._readers, []
        retries = int(getattr(self.source, "store_retries", 0))
        new_retries, self._store_retries = retries - getattr(self, "_store_retries", 0), retries
        return {
            "chunks_decoded": sum(r.decoded for r in readers),
            "peak_buffered_samples": max((r.peak_live_samples for r in readers), default=0),
            "store_retries": new_retries,
        }

    def teardown(self, replica: ReplicaContext) -> None:
        self._close()

    def __getstate__(self) -> dict[str, Any]:  # runtime state stays on the worker
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
