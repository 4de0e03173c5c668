"""AllReduce: the mean gradient of the global batch on every replica, overlapped; with
local updates (``dataflow.sync.Local``), the replicas' sample-weighted average of their
weights at the end of each window instead; with asynchronous updates
(``dataflow.sync.Async``), each step's push to the parameter store and the pull of the
weights it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dataflow.core import kinds
from dataflow.core.errors import ConfigError
from dataflow.ops.flat import grad_squared_norm
from dataflow.stages.averaging import EMA_KEY
from dataflow.stages.base import Gradients, PhaseContext, ReplicaContext, Stage, StepContext
from dataflow.stages.clipping import GRAD_NORM, clip_gradients_
from dataflow.stages.reducer import BucketReducer

# what each bucket travels as, and its bytes on the wire per fp32 gradient byte
WIRE_SCALE = {"fp32": 1.0, "bf16": 0.5}
GRAD_SQ = "grad_sq"  # step.metrics key: |G|^2 of the reduced gradient (a float or 0-d tensor)


@dataclass(kw_only=True, frozen=True)
class AllReduceConfig:
    # None: the fit's cost model plans it (TrainerConfig.cost_model), else 25 MiB
    bucket_mb: float | None = None
    # what the gradient buckets travel as: "fp32", or "bf16" (half the bytes)
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.dtype not in WIRE_SCALE:
            raise ConfigError(
                f"AllReduce(dtype={self.dtype!r}) (Pipeline(allreduce_dtype=...)): use "
                "'fp32' (exact) or 'bf16' (half the bytes on the wire, each replica's "
                "weighted gradient rounded to bf16 before the sum)"
            )
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise ConfigError(
                f"AllReduce(bucket_mb={self.bucket_mb}): the bucket size in MiB must be > 0 "
                "(25 is a good default; smaller starts communication earlier)"
            )


class AllReduce(Stage):
    """Buckets of ``bucket_mb`` MiB start reducing from backward hooks as they fill
    (default: the size the fit's cost model plans, else 25 MiB, DDP's).

    At setup, rank 0's weights are broadcast so every replica starts identical.
    ``dtype="bf16"`` sends each bucket as bf16 (half the bytes; synchronous updates
    only: under local or asynchronous updates weights, not gradients, would be rounded).
    With one replica it does nothing. Each step it leaves the reduced gradient's squared
    norm in ``step.metrics["grad_sq"]`` (on the device, not synced) for Update's
    non-finite check; with one replica only when it measures the noise scale.
    """

    kind = kinds.ALLREDUCE  # its exposed time is waiting on peers

    DEFAULT_BUCKET_MB = 25.0

    def __init__(
        self, *, bucket_mb: float | None = None, dtype: str = "fp32", name: str | None = None
    ) -> None:
        super().__init__(name)
        self.config = AllReduceConfig(bucket_mb=bucket_mb, dtype=dtype)

    @property
    def wire_scale(self) -> float:
        """Bytes each allreduce moves per fp32 gradient byte (0.5 over a bf16 wire)."""
        return WIRE_SCALE[self.config.dtype]

    @property
    def bucket_mb(self) -> float:
        """The bucket size this stage asks for: the user's, or the default. A fit whose
        user left it to the engine plans one (``driver/fit_settings``, in the history's
        ``fit_plan``) and hands it to the replicas, not to this stage."""
        return self.config.bucket_mb or self.DEFAULT_BUCKET_MB

    def bucket_in_use(self, replica: ReplicaContext) -> float:
        """The user's bucket, else the one the fit planned, else the default."""
        return self.config.bucket_mb or replica.planned_bucket_mb or self.DEFAULT_BUCKET_MB

    def setup(self, replica: ReplicaContext) -> None:
        self._reducer = None
        spatial = getattr(replica, "spatial", None)
        size = spatial.group.size if spatial is not None else 1
        # a spatial layout's replica is a group of workers, each with a part of its
        # gradient: noise measurements sum the parts over the group first, and only the
        # group's first worker reports them (the driver counts each replica once)
        self._sample_group = spatial.collective if size > 1 else None
        self._reports = spatial is None or spatial.rank == 0
        self._replicas = replica.world_size // size
        self._local = replica.local_updates
        self._async = replica.asynchronous is not None
        # (step, part) -> (local, global) samples trained in this window
        self._window: dict[tuple[int, int], tuple[int, int]] = {}
        self._window_range: tuple[int, int] | None = None
        if replica.collective is None:  # one worker: nothing to reduce
            return
        if replica.model is None:
            raise ConfigError(f"{self.name}: needs a Forward stage upstream to build the model")
        state = list(replica.model.parameters()) + list(replica.model.buffers())
        replica.collective.broadcast([t.data for t in state], src=0)
        if self._local or self._async:  # no per-step reduction
            return
        self._reducer = BucketReducer(
            list(replica.model.parameters()),
            replica.collective,
            cap_bytes=int(self.bucket_in_use(replica) * 2**20),
            sample_group=self._sample_group if self._replicas > 1 else None,
            wire_dtype=torch.bfloat16 if self.config.dtype == "bf16" else None,
        )

    def regroup(self, replica: ReplicaContext) -> None:
        """New replicas joined: rank 0's weights reach them by the same broadcast as at
        setup (they run ``setup`` while the others run this), then new buckets."""
        self.teardown(replica)
        self.setup(replica)

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None:
        self._measure = phase.measure_noise  # local/asynchronous updates: every window
        self._measures = phase.measures  # synchronous: the steps of the schedule's cadence
        self._window = {}
        self._global_of = {spec.index: spec.global_batch for spec in phase.steps}

    def begin_step(self, step: StepContext) -> None:
        measures = getattr(self, "_measures", None)
        self._measuring = measures is not None and measures(step.spec.index)
        if self._reducer is not None:
            # fp16: packing already weights each gradient, so it divides the loss scale
            # out too; everything after the allreduce sees unscaled gradients
            self._reducer.begin_step(
                step.weight / loss_scale_of(step.replica),
                measure=self._measuring and self._replicas > 1,
            )
        if not self._local:  # (asynchronous updates: the store tracks each part)
            return
        if step.replica.window is not self._window_range:
            # a new window, or the replay of one rolled back (the runtime's tuple is new
            # each time): what it trained starts from nothing
            self._window, self._window_range = {}, step.replica.window
            if step.replica.local.outer:  # DiLoCo: the window's start
                self._start = [p.detach().clone() for p in step.replica.model.parameters()]
        self._window[(step.spec.index, step.owner)] = (step.local_batch, step.global_batch)

    def begin_micro_batch(self, step: StepContext) -> None:
        """Only the last micro-batch's backward reduces. Measuring noise with one replica,
        the first micro-batch's gradient is read before the second one adds to it."""
        if self._reducer is not None:
            self._reducer.arm(step.last_micro_batch)
        if not getattr(self, "_measuring", False) or self._replicas > 1:
            return
        if step.micro_index == 0:
            self._first_micro = (step.micro_size, step.micro_weight)
        elif step.micro_index == 1:
            weight = self._first_micro[1] * loss_scale_of(step.replica)
            first_sq = self._replica_grad_sq(step.replica.model)
            self._first_micro_sq = first_sq / weight**2  # on the device: no sync mid-step

    def run(self, step: StepContext, grads: Gradients) -> Gradients:
        store = step.replica.parameter_store
        unreduced = getattr(self, "_async", False) or getattr(self, "_local", False)
        if unreduced and getattr(self, "_measure", False) and self._replicas > 1:
            self._measure_at_window_start(step)
        if getattr(self, "_async", False) and store is not None:
            # The store applies the weighted gradient (at most `staleness` versions late)
            # and returns the weights it produced: Update has nothing left to do.
            # (the store client notes each staleness; the part names what was applied)
            if (max_norm := step.replica.clip_grad_norm) is not None:
                step.metrics[GRAD_NORM] = clip_gradients_(step.replica.parameters(), max_norm)
            reply = store.push(step.weight, part=(step.spec.index, step.owner))
            step.metrics["store_wait_s"] = reply["waited_s"]
            # the store refuses exactly the pushes that are not finite: known here at once
            # (with overlap its reply comes a step late), so Update skips this very step
            if not reply["finite"]:
                step.metrics["refused_non_finite"] = True
            return Gradients(samples=grads.samples, reduced=True, applied=True)
        if self._reducer is not None:
            self._reducer.finish()
            step.metrics[GRAD_SQ] = self._reducer.grad_sq
        elif not unreduced and (scale := loss_scale_of(step.replica)) != 1.0:
            unscale_grads_(step.replica.model, scale)  # one replica: nothing packed them
        if getattr(self, "_measuring", False) and not (unreduced and self._replicas > 1):
            self._record_norms(step)
        return Gradients(samples=grads.samples, reduced=True)

    def _measure_at_window_start(self, step: StepContext) -> None:
        """Local or asynchronous updates measure the noise scale once per window, on
        each replica's first part: every replica starts a window on the same weights,
        so their first gradients, allreduced once (weighted by samples), are a big
        batch's gradient on those weights. The pair is keyed by the window's first step."""
        window = step.replica.window
        if window is None or window is getattr(self, "_measured", None):
            return
        self._measured = window
        flat = _flat_grads(step.replica.model)
        if flat is None:
            return
        flat = flat.to(torch.float64)
        local, local_sq = step.local_batch, float(flat.dot(flat))
        both = torch.cat([flat * local, flat.new_tensor([float(local)])])
        step.replica.collective.allreduce(both)
        total = float(both[-1])
        big = both[:-1] / total if total else both[:-1]
        if 0 < local < total and self._reports:
            pairs = step.metrics.setdefault("norm_pairs", [])
            pairs.append((window[0], local, local_sq, round(total), float(big.dot(big))))

    def _record_norms(self, step: StepContext) -> None:
        """One (small batch, |g_small|^2, big batch, |g_big|^2) pair per measured step,
        for the driver's noise-scale estimate: this replica's local batch inside the
        global batch, or (one replica) its first micro-batch inside its local batch. The
        squared norms stay on the device (0-d tensors, no sync in the step); they go back
        with the window (``step.metrics["norm_pairs"]``, read once at its end by
        ``dataflow.runtime.window_parts.host_pairs``), so the driver counts only
        committed steps, whatever a lost worker rolls back."""
        index, local, total = step.spec.index, step.local_batch, step.global_batch
        pairs = step.metrics.setdefault("norm_pairs", [])
        if self._replicas > 1:
            if 0 < local < total and self._reports:
                # the packed buffer held (b_r/B) g_r (fp16: the packing divided the loss
                # scale out), so (b_r/B)^2 divides out of its squared norm
                local_sq = self._reducer.local_sq / step.weight**2
                pairs.append((index, local, local_sq, total, self._reducer.grad_sq))
        elif step.spec.micro_batches_of(step.replica.rank) > 1 and hasattr(self, "_first_micro"):
            size, _ = self._first_micro
            if size is not None and 0 < size < local:
                # after the reducer (a one-group spatial layout) the grads are the
                # group's whole gradient already; without one, this worker's
                local_sq = _grad_squared_norm(step.replica.model)
                step.metrics[GRAD_SQ] = local_sq  # the whole local gradient: Update's too
                if self._reports:
                    pairs.append((index, size, self._first_micro_sq, local, local_sq))
            del self._first_micro

    def end_window(self, replica: ReplicaContext) -> dict[str, float] | None:
        """Local updates: the replicas' weights (optimizer state, buffers) become their
        average weighted by the samples each trained on in this window (integer buffers,
        BatchNorm's ``num_batches_tracked``, rounded). Asynchronous updates: the runtime
        took the store's weights, optimizer state and buffers (BatchNorm statistics,
        averaged the same way) already."""
        if not getattr(self, "_local", False):
            return None
        if replica.parameter_store is not None:
            drift = self._average_at_store(replica, replica.parameter_store)
        else:
            drift = self._average_collectively(replica)
        self._window = {}
        if replica.local.outer:
            outer_step_(replica, self._start)
            self._start = None
        return None if drift is None else {"drift": drift}

    def _average_collectively(self, replica: ReplicaContext) -> float | None:
        """Local updates on a spatial layout: the average by allreduces (one per dtype),
        the drift with it; None with no peer."""
        samples, total = _window_shares(self._window, self._global_of, replica.window)
        weight = samples / total if total else 1.0 / replica.world_size
        if replica.collective is None:
            return None
        own = [p.detach().reshape(-1) for p in replica.model.parameters()]
        before = torch.cat(own).double() if own else None
        average_weighted_(_local_state(replica), weight, replica.collective)
        average_counts_(replica.model, weight, replica.collective)
        if before is None:
            return None
        return weights_drift(before, replica.model, weight, replica.collective)

    def _average_at_store(self, replica: ReplicaContext, store: Any) -> float:
        """Local updates through the parameter store (``dataflow/ps/average.py``): hand
        in this replica's state, the parts it trained and its verdict; if a replica was
        lost in the window, train a share of its parts (``replica.retrain``, which runs
        the steps through this stage again) and hand in again; then take the average."""
        parameters = sum(p.numel() for p in replica.model.parameters())
        averaged: list[Any] = []

        def hand_in() -> dict[str, Any]:  # (after a retrain round: the tensors moved on)
            averaged[:] = _local_state(replica) + _count_buffers(replica.model)
            flat = [t.detach().reshape(-1).to("cpu", torch.float64) for t in averaged]
            verdict = replica.window_verdict
            samples, _ = _window_shares(self._window, self._global_of, replica.window)
            return {
                "parts": frozenset(self._window),
                "samples": samples,
                "state": torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64),
                "parameters": parameters,
                "first_bad": None if verdict is None else verdict(),
            }

        reply = store.average(replica.window[1], replica.window_parts, hand_in, replica.retrain)
        offset, average = 0, reply["average"]
        with torch.no_grad():
            for t in averaged:
                value = average[offset : offset + t.numel()].view(t.shape)
                t.copy_(value if t.is_floating_point() else value.round())
                offset += t.numel()
        return float(reply["drift"])

    def _replica_grad_sq(self, model: Any) -> Any:
        """|g|^2 of the replica's accumulated gradient: this worker's, or on a spatial
        layout the sum of the group's parts (one allreduce of a flat copy)."""
        if self._sample_group is None:
            return _grad_squared_norm(model)
        flat = _flat_grads(model)
        if flat is None:
            return 0.0
        self._sample_group.allreduce(flat)
        return grad_squared_norm([flat])

    def end_phase(self, replica: ReplicaContext) -> dict[str, Any]:
        """Average floating-point buffers (BatchNorm running statistics) over replicas.

        Each replica updates its running statistics from its own local batches, so
        they drift apart; the mean is the best estimate, and afterwards every replica
        (and the model returned to the driver) holds the same state.
        """
        if self._reducer is not None:
            buffers = [b for b in replica.model.buffers() if b.is_floating_point()]
            for buffer in buffers:
                replica.collective.allreduce(buffer.data).div_(replica.collective.world_size)
            _agree_on_counts(replica)
        return {}

    def teardown(self, replica: ReplicaContext) -> None:
        if getattr(self, "_reducer", None) is not None:
            self._reducer.close()
            self._reducer = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def _agree_on_counts(replica: ReplicaContext) -> None:
    """Integer buffers (BatchNorm's ``num_batches_tracked``) set to the largest any replica
    holds, in one allreduce: a replica with no samples in a step runs no forward and
    counts one batch fewer, so the replicas' counts (and their weights' digests) would
    differ, and the fullest replica's count is the one-process loop's."""
    counts = [b for b in replica.model.buffers() if not b.is_floating_point() and b.numel() == 1]
    if not counts:
        return
    # a row per worker (a spatial layout's replica is several): replica.rank would be shared
    world, rank = replica.collective.world_size, replica.collective.rank
    rows = torch.zeros(world, len(counts), dtype=torch.float64, device=counts[0].device)
    rows[rank] = torch.stack([c.reshape(()).to(torch.float64) for c in counts])
    largest = replica.collective.allreduce(rows).amax(0)
    with torch.no_grad():
        for count, value in zip(counts, largest.unbind(), strict=True):
            count.fill_(value.to(count.dtype))


def _window_shares(
    window: dict[tuple[int, int], tuple[int, int]], global_of: dict[int, int], steps: Any
) -> tuple[int, int]:
    """The samples this replica trained in the window (its parts of the steps, and any
    taken over under sample leases) and the window's total, every step's global batch
    (``steps``, the window's range; all of a step's parts may have been trained by
    others): this replica's weight in the average is their ratio."""
    samples = sum(local for local, _ in window.values())
    return samples, sum(global_of[i] for i in range(*steps))


def _local_state(replica: ReplicaContext) -> list[Any]:
    """What local updates average: parameters, floating buffers (BatchNorm's running
    statistics) and, unless ``average_optimizer_state=False``, each parameter's
    optimizer tensors of its shape (momentum, Adam's moments); the weights' moving
    average (``ema_decay``) always, so it stays the average of the averaged weights."""
    model, optimizer = replica.model, replica.optimizer
    tensors = [p.data for p in model.parameters()]
    tensors += [b.data for b in model.buffers() if b.is_floating_point()]
    everything = replica.local.average_optimizer_state
    if optimizer is not None:
        for param in model.parameters():
            for key, value in optimizer.state.get(param, {}).items():
                if (
                    (everything or key == EMA_KEY)  # the weights' average: always
                    and key != OUTER_MOMENTUM
                    and isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and value.shape == param.shape
                ):
                    tensors.append(value)
    return tensors


OUTER_MOMENTUM = "outer_momentum"  # optimizer state key: identical on every replica


@torch.no_grad()
def outer_step_(replica: ReplicaContext, start: list[torch.Tensor]) -> None:
    """DiLoCo's outer step on the averaged weights (see ``dataflow.sync.Local``): the
    pseudo-gradient is how far the average moved from the window's start."""
    local, optimizer = replica.local, replica.optimizer
    mu = local.outer_momentum
    for param, before in zip(replica.model.parameters(), start, strict=True):
        delta = before - param
        if mu:
            state = optimizer.state[param] if optimizer is not None else {}
            buf = state.get(OUTER_MOMENTUM)
            buf = delta.clone() if buf is None else buf.mul_(mu).add_(delta)
            state[OUTER_MOMENTUM] = buf
            delta = delta.add(buf, alpha=mu) if local.nesterov else buf
        param.copy_(before - local.outer_lr * delta)


def average_weighted_(tensors: list[Any], weight: float, collective: Any) -> None:
    """``t <- sum over replicas of weight_r * t_r``, in place, one allreduce per dtype
    and device (the weights sum to 1 over the replicas)."""
    groups: dict[tuple[Any, Any], list[Any]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for members in groups.values():
        flat = torch.cat([t.reshape(-1) for t in members]).mul_(weight)
        collective.allreduce(flat)
        offset = 0
        for t in members:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def weights_drift(before: torch.Tensor, model: Any, weight: float, collective: Any) -> float:
    """How far the replicas' weights had drifted apart when they were averaged: the
    sample-weighted mean of ``|θ_r − θ̄|²`` over ``|θ̄|²`` (0: they agreed). ``before``:
    this replica's parameters, flat in float64, taken before the average; one allreduce
    of a scalar. The window's statistics, not its speed: what tells whether the period
    is too long (``sync.Local(max_drift=...)``)."""
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    spread = ((before - after).square().sum() * weight).reshape(1)
    collective.allreduce(spread)
    norm = float(after.square().sum())
    return float(spread[0]) / norm if norm > 0 else 0.0


def _count_buffers(model: Any) -> list[Any]:
    """Integer buffers (BatchNorm's ``num_batches_tracked``): averaged, then rounded."""
    return [b for b in model.buffers() if not (b.is_floating_point() or b.is_complex())]


def average_counts_(model: Any, weight: float, collective: Any) -> None:
    """Integer buffers (BatchNorm's ``num_batches_tracked``) to their weighted average over
    the replicas, rounded, as floating ones are averaged: a replica that skipped a step
    (``on_non_finite="skip"``) or trained more parts counted other batches, and every
    replica must hold the same. One small allreduce; none for a model without them."""
    counts = _count_buffers(model)
    if not counts:
        return
    flat = torch.cat([b.detach().reshape(-1).double() for b in counts]).mul_(weight)
    collective.allreduce(flat)
    offset = 0
    for b in counts:
        b.copy_(flat[offset : offset + b.numel()].round().view_as(b))
        offset += b.numel()


def _flat_grads(model: Any) -> Any:
    """Every parameter's gradient in one flat tensor, zeros where there is none (so all
    replicas' copies line up for an allreduce); None for a model without parameters."""
    grads = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        for p in model.parameters()
    ]
    return torch.cat(grads) if grads else None


def _grad_squared_norm(model: Any) -> Any:
    """Sum over parameters of |grad|^2 (0-d float64 tensor, one launch)."""
    return grad_squared_norm([p.grad for p in model.parameters()])


def loss_scale_of(replica: ReplicaContext) -> float:
    """The factor the replica's gradients carry: fp16's loss scale, else 1."""
    scale = getattr(replica, "loss_scale", None)
    return 1.0 if scale is None else float(scale.scale)


def unscale_grads_(model: Any, scale: float) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0 / scale)
