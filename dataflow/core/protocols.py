"""The contracts between layers, apart from their implementations.

A new data source, collective, kernel, schedule or balancer implements one of these
and the engine depends only on the contract: each is a ``runtime_checkable``
``Protocol``, and the engine checks a user's object against it where it takes it in
(``stages.Load`` a :class:`Source`, the trainer a :class:`Schedule` and a
:class:`Balancer`, ``Graph.add`` a :class:`Stage`, ``ops.register`` a
:class:`Kernel`). A source that stores samples in chunks also implements
:class:`ChunkedSource` (its chunks as runs of samples, ``chunk_bounds``, or as any
sets of samples, ``chunk_members``), and Load then decodes each chunk once per epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from dataflow.core.batch import Batch
    from dataflow.core.phase import PhaseMeasurement, PhaseSpec
    from dataflow.core.step import PhaseContext, ReplicaContext, StepContext

__all__ = [
    "Balancer",
    "ChunkedSource",
    "Collective",
    "Kernel",
    "Schedule",
    "Source",
    "Stage",
    "missing_members",
]


@runtime_checkable
class Source(Protocol):
    """Samples along a leading dimension, read by index (what ``stages.Load`` needs).

    An attribute ``shuffle: bool`` (draw a new order each epoch) is optional: absent
    means True, so a source written with only these two members fits.
    """

    @property
    def num_samples(self) -> int: ...

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices``, in that order."""
        ...


@runtime_checkable
class ChunkedSource(Protocol):
    """A source whose storage unit (a chunk) is read whole: a set of samples.

    Besides the methods below it names its chunks in one of two ways (the protocol
    cannot say "one of", so ``io.chunk_index.is_chunked`` checks it):

    - ``chunk_bounds``: ``C + 1`` sample offsets; chunk ``c`` holds the consecutive
      samples ``[b[c], b[c+1])`` (a zarr store along its sample dim, a dask array);
    - ``chunk_members``: a list of ``C`` sorted int64 arrays, the sample indices chunk
      ``c`` holds, together a partition of the samples (the windows of a block of a
      large array, which are not consecutive: ``io.PatchSource``). ``read_chunks``
      then returns each chunk's samples in that order. A source with both uses the
      members.

    The epoch's order (``io.sharding``) shuffles chunks, then samples within groups of
    ``buffer_chunks`` chunks, so each chunk is decoded once per replica and epoch.
    """

    def check_chunks(self, chunks: Sequence[int]) -> None:
        """Raise ``ChunkMissingError`` if any of ``chunks`` is absent from the store."""
        ...

    def read_chunks(self, chunks: Sequence[int]) -> dict[int, Batch]:
        """Decode ``chunks`` (ideally concurrently); each value holds that chunk's samples,
        sample dim first, as numpy arrays or CPU tensors."""
        ...

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices`` (used only for an empty batch)."""
        ...


@runtime_checkable
class Collective(Protocol):
    """What the allreduce needs from a process group over the replicas."""

    rank: int
    world_size: int

    def allreduce_async(self, tensor: torch.Tensor) -> Any:
        """Start an in-place sum; return a handle with ``wait()``."""
        ...

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class Kernel(Protocol):
    """One op: ``cpu(*arrays, **params)`` takes numpy arrays, ``cuda(*device_arrays,
    stream=, **params)`` numba device arrays (None: no Numba CUDA kernel; ``ops.Op`` may
    then run torch code on CUDA), and ``reference`` is the plain torch/numpy definition
    both are tested against (``dataflow.ops.Op``)."""

    name: str
    cpu: Callable[..., Any]
    cuda: Callable[..., Any] | None
    reference: Callable[..., Any]
    dtypes: tuple[torch.dtype, ...]


@runtime_checkable
class Schedule(Protocol):
    """Chooses each phase; ``previous`` is None for the first one.

    ``measured`` is what the driver measured during ``previous`` (None for the first
    phase, or when nothing was measured). An attribute ``measures_noise`` that is True
    (a class attribute, or a property: ``Stepwise`` measures only for its AdaScale LR
    rules) asks the driver to pay for the gradient-norm measurement that feeds
    ``measured.noise_scale``, on every ``measure_interval(phase_steps)``-th step when the
    schedule has that method; both are optional (absent: False), so a schedule
    written with only ``next_phase`` and ``max_batch`` still fits the protocol. One
    whose ``counts_progress`` is True counts ``total_epochs`` in its own units
    (``scale_invariant=True``: progress): the fit then ends when
    ``next_phase`` returns None, not at an epoch of data.
    """

    def next_phase(
        self,
        *,
        start_epoch: int,
        total_epochs: int,
        previous: PhaseSpec | None,
        measured: PhaseMeasurement | None = None,
    ) -> PhaseSpec | None: ...

    def max_batch(self) -> int:
        """The largest global batch this schedule can ask for (validated up front)."""
        ...


@runtime_checkable
class Balancer(Protocol):
    """Chooses the per-replica split of each global batch.

    ``measured`` is, per finished phase, each replica's measured samples/s (the
    engine's view of its compute speed); balancers that ignore speed ignore it.
    """

    def split(
        self, global_batch: int, replicas: int, measured: Sequence[Sequence[float]] = ()
    ) -> tuple[int, ...]: ...


@runtime_checkable
class Stage(Protocol):
    """What the replica runtime calls on a stage (``dataflow.stages.Stage`` implements
    all of it with defaults; subclass that rather than writing this from scratch).

    ``setup`` once per fit, ``begin_phase``/``end_phase`` around each phase,
    ``begin_step`` then ``run`` once per step in graph order; ``kind`` says what the
    stage's time counts as (:mod:`dataflow.core.kinds`).
    """

    name: str
    kind: str
    per_micro_batch: bool
    pairs_micro_batches: bool  # its forward reduces over the replicas (sync_batchnorm)

    @property
    def waits_on_peers_or_data(self) -> bool: ...

    def setup(self, replica: ReplicaContext) -> None: ...

    def regroup(self, replica: ReplicaContext) -> None: ...

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None: ...

    def phase_state(self) -> dict[str, Any] | None: ...

    def load_phase_state(self, state: dict[str, Any]) -> None: ...

    def begin_step(self, step: StepContext) -> None: ...

    def begin_micro_batch(self, step: StepContext) -> None: ...

    def run(self, step: StepContext, *inputs: Any) -> Any: ...

    def end_phase(self, replica: ReplicaContext) -> dict[str, Any]: ...

    def teardown(self, replica: ReplicaContext) -> None: ...


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks, for an error message that names
    them (``isinstance`` against a protocol only says yes or no)."""
    members = sorted(getattr(protocol, "__protocol_attrs__", None) or _protocol_attrs(protocol))
    return [name for name in members if not hasattr(obj, name)]


def _protocol_attrs(protocol: type) -> set[str]:
    """Python < 3.12 keeps no ``__protocol_attrs__``: the names the protocol declares."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base in (Protocol, Generic, object) or not getattr(base, "_is_protocol", False):
            continue
        names |= set(getattr(base, "__annotations__", {}))
        names |= {n for n in vars(base) if not n.startswith("_")}
    return names
