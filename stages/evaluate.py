"""Evaluate: metrics on a held-out source at the end of every N epochs.

Each replica evaluates an equal contiguous shard; the driver combines the
per-replica sums, so the result is the metric over the whole held-out set.

The held-out batches go through the same deterministic preprocessing as the
training batches (the graph's ``Transform`` stages before ``Forward``, e.g. ``Log1p``,
``Standardize``), so the model is evaluated on inputs like those it was trained on;
random augmentations (``wants_seed``: ``RandomFlip``, ``RandomRotate90``) are left out,
so an evaluation is the same whatever the step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dataflow.core import kinds
from dataflow.core.errors import CollectiveError, ConfigError, GraphError
from dataflow.core.window import WHOLE
from dataflow.io.chunk_index import is_chunked
from dataflow.io.chunk_reader import EpochChunkReader, auto_decode_threads
from dataflow.io.prefetch import Prefetcher
from dataflow.io.sharding import source_chunk_members
from dataflow.stages.averaging import SwappedIn
from dataflow.stages.base import Stage, StepContext
from dataflow.stages.forward import Forward, call_model
from dataflow.stages.held_out_checks import check_finite, metric_error
from dataflow.stages.transform import Transform


def accuracy(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fraction of samples whose arg-max class equals the integer target."""
    return (output.argmax(dim=1) == y).float().mean()


@dataclass(kw_only=True, frozen=True)
class EvaluateConfig:
    metrics: dict[str, Callable[..., torch.Tensor]] = field(default_factory=dict)
    every_epochs: int = 1
    batch_size: int = 256

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ConfigError(
                "Evaluate(metrics=...): give at least one metric, e.g. "
                "{'loss': torch.nn.functional.cross_entropy, 'accuracy': stages.accuracy}"
            )
        for key, fn in self.metrics.items():
            if not callable(fn):
                raise ConfigError(f"Evaluate(metrics={{{key!r}: ...}}): metric must be callable")
        if not isinstance(self.every_epochs, int) or self.every_epochs < 1:
            raise ConfigError(f"Evaluate(every_epochs={self.every_epochs!r}): must be an int >= 1")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"Evaluate(batch_size={self.batch_size!r}): must be an int >= 1")


def is_random(fn: Any) -> bool:
    """Whether a transform draws random choices (``wants_seed``, as ``stages.Transform``
    reads it): an augmentation, never applied at evaluation."""
    return bool(getattr(fn, "wants_seed", False))


def _upstream(graph: Any, name: str) -> set[str]:
    seen: set[str] = set()
    frontier = [name]
    while frontier:
        for parent in graph.inputs_of(frontier.pop()):
            if parent in graph and parent not in seen:
                seen.add(parent)
                frontier.append(parent)
    return seen


def _in_run_order(graph: Any, names: set[str]) -> list[str]:
    """``names`` ordered inputs first (a topological order of the subgraph)."""
    order: list[str] = []
    pending = {n: {p for p in graph.inputs_of(n) if p in names} for n in names}
    while pending:
        ready = [n for n in (s.name for s in graph) if n in pending and not pending[n]]
        if not ready:
            raise GraphError(f"the stages {sorted(pending)} form a cycle")
        for n in ready:
            order.append(n)
            del pending[n]
        for deps in pending.values():
            deps.difference_update(ready)
    return order


def graph_eval_transforms(graph: Any, evaluate_name: str | None = None) -> tuple[Transform, ...]:
    """The ``Transform`` stages that feed ``graph``'s Forward, in run order, without the
    random ones: what evaluation applies to held-out batches.

    The Forward is the one upstream of the Evaluate stage ``evaluate_name`` (or, if none
    is, the graph's only Forward). Several candidate Forwards are ambiguous: pass
    ``Evaluate(transforms=[...])`` then.
    """
    forwards = [s.name for s in graph if isinstance(s, Forward)]
    if evaluate_name is not None:
        upstream = _upstream(graph, evaluate_name)
        forwards = [n for n in forwards if n in upstream] or forwards
    if not forwards:
        return ()
    if len(forwards) > 1:
        raise GraphError(
            f"Evaluate {evaluate_name!r}: the graph has several Forward stages ({forwards}), "
            "so which transforms to apply to the held-out data is ambiguous; pass them, e.g. "
            "Evaluate(source, metrics=..., transforms=[dfl.ops.Log1p()])"
        )
    names = _in_run_order(graph, _upstream(graph, forwards[0]))
    stages = [graph[n] for n in names if isinstance(graph[n], Transform)]
    return tuple(t for t in stages if not is_random(t.config.fn))


AVERAGE_PREFIX = "ema_"  # the weights' moving average's metrics: eval_ema_loss, ...


class Evaluate(Stage):
    """Adds ``{"eval": {"count": n, name: sum, ...}}`` to the metrics of an epoch's last step.

    ``transforms``: what to apply to each held-out batch before the model, as functions
    (applied to ``x``) or ``stages.Transform`` stages (their ``apply_to``). ``None``
    (default) means the graph's own deterministic transforms before Forward, found by
    :meth:`bind` (the trainer binds every Evaluate of its graph); ``()`` means none.
    Random transforms (``wants_seed``) are refused here and skipped from the graph.
    """

    kind = kinds.EVALUATE

    def __init__(
        self,
        source: Any,
        *,
        metrics: dict[str, Callable[..., torch.Tensor]],
        every_epochs: int = 1,
        batch_size: int = 256,
        transforms: Sequence[Callable[[Any], Any] | Transform] | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.source = source
        self.config = EvaluateConfig(
            metrics=dict(metrics), every_epochs=every_epochs, batch_size=batch_size
        )
        self.follows_graph = transforms is None
        self.transforms: tuple[tuple[Callable[[Any], Any], str], ...] = ()
        if transforms is not None:
            self.transforms = _as_pairs(transforms)

    def bind(self, graph: Any) -> None:
        """Take the deterministic transforms of ``graph`` (the one this stage is in) that
        precede Forward, unless ``transforms=`` was given. Called on the driver before the
        graph is sent to the workers; calling it again re-reads the graph."""
        if self.follows_graph:
            self.transforms = _as_pairs(graph_eval_transforms(graph, self.name))

    def setup(self, replica: Any) -> None:
        if replica.spatial is not None:  # a spatial layout: this worker's region only
            self.source = replica.spatial.region_of(self.source)

    def run(self, step: StepContext, *inputs: Any) -> Any:
        spec = step.spec
        due = spec.last_in_epoch and (spec.epoch + 1) % self.config.every_epochs == 0
        if due and step.part is None:  # not on another replica's part (sample leases)
            if step.replica.settles_at_window_end:  # after the window's average or store sync
                self._due = step
            else:
                step.metrics["eval"] = whole_set(step.replica, self.evaluate_shard(step))
        return inputs[0] if inputs else None

    def end_window(self, replica: Any) -> None:
        """Local or asynchronous updates: the epoch's last step ends its window
        (``Plan.build``), and the evaluation waits for the window's end, where the
        replicas' weights are averaged (or taken from the parameter store): it scores
        the shared model, not this replica's own. With a parameter store the replicas'
        sums meet there (not in the process group, which a loss may have aborted):
        each result then holds the whole set's, so a replica lost after it scored
        takes no share with it (its result may never reach the driver)."""
        step = getattr(self, "_due", None)
        if step is None:
            return
        self._due = None
        scores = self.evaluate_shard(step)
        store = replica.parameter_store
        if store is not None and replica.world_size > 1:
            handed = store.sum_held_out(step.spec.index, scores)
            scores = whole_from_shares(
                handed, replica.world_size, lambda rank: self.evaluate_shard(step, rank)
            )
        step.metrics["eval"] = scores

    def prepare(self, batch: Any, device: torch.device) -> Any:
        """A held-out batch on ``device`` with the evaluation transforms applied, as the
        training graph's Load and Transform stages prepare a training batch."""
        batch.x = _to_device(batch.x, device)
        batch.y = _to_device(batch.y, device)
        for fn, apply_to in self.transforms:
            setattr(batch, apply_to, fn(getattr(batch, apply_to)))
        return batch

    def evaluate_shard(self, step: StepContext, rank: int | None = None) -> dict[str, float]:
        """Sums of the metrics over replica ``rank``'s share of the held-out set (this
        replica's by default), and its ``count``."""
        replica = step.replica
        rank = replica.rank if rank is None else rank
        n = self.source.num_samples
        lo = n * rank // replica.world_size
        hi = n * (rank + 1) // replica.world_size
        average = None
        if replica.averages_weights:  # ema_decay: the average is scored too (ema_<name>)
            average = SwappedIn(replica.model, replica.optimizer)
        return self.score_range(replica.model, replica.device, lo, hi, average=average)

    def score_range(
        self, model: Any, device: Any, lo: int, hi: int, *, average: Any = None
    ) -> dict[str, float]:
        """Sums of the metrics over the held-out samples ``[lo, hi)`` scored by ``model``
        on ``device`` (in eval mode, then back in train mode), and their ``count``: one
        replica's share in a fit, one worker's in :func:`dataflow.evaluation.evaluate`.
        ``average`` (a :class:`~dataflow.stages.averaging.SwappedIn`): each batch is
        scored by the weights' moving average too, as ``ema_<name>``."""
        sums = dict.fromkeys(self.config.metrics, 0.0)
        if average is not None:
            sums |= {f"{AVERAGE_PREFIX}{key}": 0.0 for key in self.config.metrics}
        with contextlib.closing(self.outputs(model, device, lo, hi)) as outputs:
            for indices, batch, output in outputs:
                self._add(sums, "", output, batch, indices)
                if average is not None:
                    with average, torch.no_grad():
                        averaged = call_model(model, batch.x)
                    check_finite(self.source, indices, batch, averaged)
                    self._add(sums, AVERAGE_PREFIX, averaged, batch, indices)
        return {"count": hi - lo, **sums}

    def _add(self, sums: dict, prefix: str, output: Any, batch: Any, indices: Any) -> None:
        """The batch's metrics of ``output`` added to ``sums`` (as ``prefix<name>``)."""
        y = batch.y
        for key, fn in self.config.metrics.items():
            value = float(fn(output) if y is None else fn(output, y))
            if not math.isfinite(value):
                raise metric_error(self.source, prefix + key, value, indices)
            sums[prefix + key] += value * batch.size

    def outputs(
        self, model: Any, device: Any, lo: int, hi: int, *, only: np.ndarray | None = None
    ) -> Iterator[tuple[np.ndarray, Any, Any]]:
        """The held-out samples ``[lo, hi)`` (those of them in ``only``, ascending, when
        given: a stitched field's windows over a share) in batches, each prepared (on
        ``device``, the evaluation transforms applied) and run through ``model`` in eval
        mode without gradients: ``(indices, batch, output)``, a non-finite output refused
        naming its samples. ``model`` is back in train mode when the iteration ends or is
        closed."""
        batches = held_out_batches(self.source, lo, hi, self.config.batch_size, only=only)
        reading = self._held_out_reading(batches, device)
        self._reading = reading
        interrupted = getattr(self, "_interrupted", None)
        if interrupted is not None:  # the abort came as this reading began
            self._abandon(reading, interrupted)
        model.eval()
        try:
            for indices in batches:
                batch = self.prepare(reading.get(), device)
                with torch.no_grad():  # (not held across a yield: it is per thread)
                    output = call_model(model, batch.x)
                check_finite(self.source, indices, batch, output)
                yield indices, batch, output
        finally:
            self._reading = self._reader = None
            reading.close()
            model.train()

    def _held_out_reading(self, batches: list[np.ndarray], device: Any) -> Prefetcher:
        """The held-out ``batches``, read on a thread ahead of the model (a remote store's
        latency hides behind the forward passes), so that a read the driver aborts (a
        store outage) ends the wait. A chunked source (zarr, dask) is read as training
        reads it, through an :class:`~dataflow.io.chunk_reader.EpochChunkReader`: each
        chunk decoded once, however many batches it spans, its chunks checked to exist
        first, and a remote store's objects fetched ahead, many at once (a batch's worth
        of GETs one after another would each wait a round trip). A window source's unit
        (``PatchSource``) is read whole, once: read batch by batch, each batch would
        read again every unit it touches (100x slower on a 16k-window field)."""
        self._reader = None
        if is_chunked(self.source):
            threads = auto_decode_threads(device)  # (on a GPU, the idle host cores)
            self._reader = EpochChunkReader(self.source, batches, decode_threads=threads)
            return Prefetcher(_as_is, self._reader)
        return Prefetcher(self.source.read, batches)

    def interrupt(self, reason: str) -> None:
        """The window was aborted while this replica may wait for a held-out batch: the
        reading in progress, or one beginning now, ends (until the next phase begins,
        as every recovery's redo does)."""
        error = CollectiveError(f"{reason} while it waited for a batch of the held-out set")
        self._interrupted = error
        reading = getattr(self, "_reading", None)
        if reading is not None:
            self._abandon(reading, error)

    def _abandon(self, reading: Prefetcher, error: BaseException) -> None:
        """The wait for ``reading`` ends with ``error``; a read of it retrying a failing
        store gives up now (nobody will take its batches)."""
        reading.interrupt(error)  # first: the abandoned read's failure is not the cause
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.abandon()

    def begin_phase(self, replica: Any, phase: Any) -> None:
        self._interrupted = None  # an abort of a window the recovery replaced

    def __getstate__(self) -> dict[str, Any]:
        """Without the reading in progress (its prefetch thread and locks): Dask may copy
        the stage from a worker scoring a share with it to another that lost its own
        copy (``Pipeline.evaluate`` scatters it once; a stolen share fetches it), and a
        stage that could not be pickled then left ``evaluate`` waiting for good."""
        state = self.__dict__.copy()
        for transient in ("_reading", "_reader", "_interrupted"):
            state.pop(transient, None)
        return state


def _as_is(batch: Any) -> Any:
    return batch


def whole_set(replica: Any, scores: dict[str, float]) -> dict[str, float]:
    """``scores`` (this replica's share's sums) summed over the replicas' process group,
    marked ``WHOLE``: every replica's result then holds the whole held-out set's scores,
    so a replica lost after it evaluated, whose result never reached the driver, takes
    no share of them with it (a window its partners finished is kept whole). Synchronous
    training only, whose group allreduces every step (under local or asynchronous
    updates the group may be aborted while the fit goes on; they sum at the parameter
    store instead). Under a spatial layout the group holds each replica's P workers,
    which all score the replica's share on the same gathered output: the sum over the
    group, divided by P."""
    group = replica.collective
    if group is None or replica.world_size < 2:
        return scores
    if replica.settles_at_window_end:
        return scores
    keys = sorted(scores)
    totals = torch.tensor([float(scores[k]) for k in keys], dtype=torch.float64)
    totals = totals.to(replica.device)
    handle = group.allreduce_async(totals)
    wait = getattr(group, "wait", None)  # the runtime's: fails at once on an aborted group
    wait(handle) if wait is not None else handle.wait()
    parts = 1 if replica.spatial is None else replica.spatial.group.size
    return _marked_whole({k: v / parts for k, v in zip(keys, totals.cpu().tolist(), strict=True)})


def whole_from_shares(
    handed: dict[int, dict[str, float]], replicas: int, score_share: Callable[[int], dict]
) -> dict[str, float]:
    """The whole held-out set's sums, marked ``WHOLE``, from the shares ``handed`` in by
    replica; a share nobody handed in (its replica was lost before) is scored here by
    ``score_share(rank)``. Summed in rank order: the same on every survivor."""
    shares = [handed[r] if r in handed else score_share(r) for r in range(replicas)]
    return _marked_whole({key: math.fsum(share[key] for share in shares) for key in shares[0]})


def _marked_whole(summed: dict[str, float]) -> dict[str, float]:
    """Sums over every replica's share: the count an integer, the set marked ``WHOLE``."""
    summed["count"] = round(summed["count"])
    summed[WHOLE] = 1.0
    return summed


def held_out_batches(
    source: Any, lo: int, hi: int, size: int, *, only: np.ndarray | None = None
) -> list[np.ndarray]:
    """The held-out samples ``[lo, hi)`` (of them, those in ``only``) in batches of
    ``size``: in index order, or for a source whose chunks are sets of samples
    (``chunk_members``: a ``PatchSource``'s units of windows) unit by unit, so that one
    unit is decoded at a time and once (in index order a unit's windows are spread over
    the whole shard, and every unit would stay decoded until its last window's batch).
    The sums do not depend on the order (up to float rounding); the order is fixed, so
    neither do the scores."""
    members = source_chunk_members(source)
    if members is None:
        if only is None:
            return [np.arange(start, min(hi, start + size)) for start in range(lo, hi, size)]
        order = np.asarray(only, dtype=np.int64)
        order = order[(order >= lo) & (order < hi)]
    else:
        order = np.concatenate([np.asarray(m, dtype=np.int64) for m in members])
        order = order[(order >= lo) & (order < hi)]
        if only is not None:
            order = order[np.isin(order, only)]
    return [order[start : start + size] for start in range(0, len(order), size)]


def bind_evaluations(graph: Any) -> None:
    """Bind every Evaluate stage of ``graph`` to it (:meth:`Evaluate.bind`): the driver
    calls this once the graph is built, before it is sent to the workers."""
    for stage in graph:
        if isinstance(stage, Evaluate):
            stage.bind(graph)


def _as_pairs(
    transforms: Sequence[Callable[[Any], Any] | Transform],
) -> tuple[tuple[Callable[[Any], Any], str], ...]:
    if callable(transforms) and not isinstance(transforms, Transform):
        transforms = [transforms]  # a single function
    pairs = []
    for item in transforms:
        fn, apply_to = (
            (item.config.fn, item.config.apply_to) if isinstance(item, Transform) else (item, "x")
        )
        if not callable(fn):
            raise ConfigError(
                f"Evaluate(transforms=[..., {item!r}]): expected functions on tensors or "
                "stages.Transform stages"
            )
        if is_random(fn):
            raise ConfigError(
                f"Evaluate(transforms=[..., {type(fn).__name__}]): a random augmentation "
                "(wants_seed) would make evaluation depend on chance; leave it out"
            )
        pairs.append((fn, apply_to))
    return tuple(pairs)


def _to_device(value: Any, device: torch.device) -> Any:
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value.to(device)
