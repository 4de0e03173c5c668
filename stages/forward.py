"""Forward: build the replica's model once, then compute the local mean loss per step."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dataflow.core.errors import (
    ConfigError,
    DataError,
    DataflowError,
    LossError,
    ModelError,
)
from dataflow.core.precision import LossScale, StepOptions, resolve_step_options
from dataflow.io.labels import float_label_error, loss_call
from dataflow.stages.base import (
    Batch,
    ForwardOutput,
    PhaseContext,
    ReplicaContext,
    Stage,
    StepContext,
)
from dataflow.stages.capture import StepCapture
from dataflow.stages.compiled import EAGER_FP32, CompiledModel, autocast, to_memory_format
from dataflow.stages.group_batchnorm import ReplicaGroup, join_batchnorm, replica_batchnorm


def _tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: itself, or those of its tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for part in output for t in _tensors_in(part)]
    return []


def call_model(model: torch.nn.Module, x: Any, device: torch.device | None = None) -> Any:
    """``model(x)``, or ``model(*x)`` for several inputs (``ZarrSource(x=[...])``)."""
    if isinstance(x, tuple):
        return model(*(v if device is None else v.to(device) for v in x))
    return model(x if device is None else x.to(device))


def build_model(factory: Callable[[], Any], seed: int) -> torch.nn.Module:
    """Call the model factory under ``seed``; refuse anything but an ``nn.Module``."""
    torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ModelError(
            f"model factory {getattr(factory, '__name__', factory)!r} returned "
            f"{type(model).__name__}, not a torch.nn.Module; pass the model class or a "
            "function that returns a new module, e.g. model=lambda: MyNet(width=32)"
        )
    tensors = (*model.named_parameters(), *model.named_buffers())
    meta = next((name for name, t in tensors if t.is_meta), None)
    if meta is not None:  # torch would say 'Cannot copy out of meta tensor' at .to(device)
        raise ConfigError(
            f"model factory {getattr(factory, '__name__', factory)!r} built the model on the "
            f"meta device: its parameters (e.g. {meta!r}) have a shape but no values to train. "
            "Build it on the CPU (drop device='meta' / torch.device('meta')), or materialise "
            "it in the factory: model.to_empty(device='cpu'), then initialise every parameter "
            "(each layer's reset_parameters(), or model.load_state_dict(weights))"
        )
    return model


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_mismatch(
    model: torch.nn.Module, x: Any, error: BaseException | None = None
) -> str | None:
    """Why ``model(x)`` cannot work when an input's dtype is not the model's (torch says
    'Input type (double) and bias type (float)' without naming the input or the fix).

    Floating inputs of another precision, and integer or bool inputs (not cast: the data
    is cast where it is made, or in a transform, as for float64). An integer input is named
    only when torch's ``error``, if given, is about types: a model may take integers
    itself (an embedding) and fail for another reason."""
    expected = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    inputs = x if isinstance(x, tuple) else (x,)
    for i, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor) or expected is None or value.is_complex():
            continue
        field = f"x[{i}]" if isinstance(x, tuple) else "x"
        want, have = _dtype(expected), _dtype(value.dtype)
        if not value.is_floating_point():
            if error is not None and "type" not in str(error).lower():
                continue
            counts = (
                ""
                if value.dtype in (torch.bool, torch.uint8)
                else f"; counts kept as integers (fewer bytes to read and copy) take their "
                f"log and the cast in one transform on the device: "
                f"transforms=[dataflow.ops.Log1p(dtype=torch.{want})]"
            )
            return (
                f"{field} is {have} but the model's parameters are {want}; cast the data to "
                f"{want} (when making it: x.astype(numpy.{want}), or a transform: "
                f"transforms=[lambda x: x.to(torch.{want})], scaled too for 8-bit images: "
                f"lambda x: x.to(torch.{want}) / 255), or cast in the model's forward "
                f"(x = x.float()){counts}"
            )
        if value.dtype == expected:
            continue
        return (
            f"{field} is {have} but the model's parameters are {want}; cast the data to {want} "
            f"(when making it: x.astype(numpy.{want}), or a transform: "
            f"transforms=[lambda x: x.to(torch.{want})]), or build the model in {have} "
            f"(model=lambda: Net().to(torch.{have})"
            + (", i.e. Net().double())" if have == "float64" else ")")
        )
    return None


def _needs_targets(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn(output)`` cannot bind: the loss takes targets."""
    fn = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    try:
        inspect.signature(fn).bind(object())
    except TypeError:
        return True
    except ValueError:  # no signature to inspect (a builtin): assume it takes one argument
        return False
    return False


def _broadcast_shape(output: Any, y: Any) -> tuple[int, ...] | None:
    """The shape ``output`` and ``y`` broadcast to when it is larger than the output's
    (an elementwise loss would then compare every output with every target), else None."""
    if not (isinstance(output, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None
    if output.shape == y.shape:
        return None
    return _larger_broadcast(output.shape, y.shape)


@functools.lru_cache(maxsize=64)
def _larger_broadcast(output: torch.Size, y: torch.Size) -> tuple[int, ...] | None:
    """:func:`_broadcast_shape` of two shapes, kept: every step of a phase asks again for
    the same pair, and torch answers a pair that does not broadcast (class logits and
    labels, the common case) with an exception, ~100 us of host work a step."""
    try:
        shape = tuple(torch.broadcast_shapes(output, y))
    except RuntimeError:  # not broadcastable: e.g. class logits (N, C) and labels (N,)
        return None
    return shape if shape != tuple(output) else None


def _call_watching_broadcast(
    loss_fn: Callable[..., Any], output: torch.Tensor, y: torch.Tensor, shape: tuple[int, ...]
) -> Any:
    """``loss_fn(output, y)`` for shapes that broadcast to a larger one. torch's elementwise
    losses (mse, l1, smooth_l1, huber) then only warn and return a wrong loss; that warning
    becomes a LossError. Losses that do not warn (e.g. they reshape themselves) pass."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = loss_fn(output, y)
    for warning in caught:
        if "different to the input size" in str(warning.message):
            raise LossError(
                f"loss function {_name(loss_fn)!r} got an output of shape "
                f"{tuple(output.shape)} and a target of shape {tuple(y.shape)}: they broadcast "
                f"to {shape}, so each output is compared with every target and the loss is "
                "wrong; give them the same shape: end the model with output.squeeze(-1) (or "
                f"output.view_as(y)), or make the targets {tuple(output.shape)} (y[:, None], in "
                "a transform or when writing the array)"
            )
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return loss


def _describe_output(output: Any) -> str:
    """``tuple of 2 (Tensor (4, 3), Tensor (4, 8))``, ``dict with keys ['logits']``."""
    if isinstance(output, dict):
        return f"dict with keys {list(output)[:5]}"
    parts = [
        f"Tensor {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
        for v in list(output)[:4]
    ]
    more = ", ..." if len(output) > 4 else ""
    return f"{type(output).__name__} of {len(output)} ({', '.join(parts)}{more})"


def output_type_error(loss_fn: Callable[..., Any], output: Any, error: BaseException) -> Any:
    """Why the loss failed when the model returned a tuple, list or dict the loss cannot
    take (torch: "argument 'input' must be Tensor, not tuple", not naming the model), or
    None. Only for a loss's TypeError or AttributeError: a loss that takes such an output
    runs as it is."""
    if not isinstance(output, (tuple, list, dict)) or not isinstance(
        error, (TypeError, AttributeError)
    ):
        return None
    pick = f"out[{next(iter(output))!r}]" if isinstance(output, dict) and output else "out[0]"
    call = loss_call(getattr(loss_fn, "loss", loss_fn))  # the dry run's WatchedLoss: its loss
    return ModelError(
        f"the model's forward returned a {_describe_output(output)}, which loss function "
        f"{_name(loss_fn)!r} cannot take: it needs a tensor. Return the tensor the loss "
        f"compares with y from the model's forward, or pick it in the loss: "
        f"loss=lambda out, y: {call}({pick}, y). torch said: {str(error).splitlines()[0]}"
    )


def compute_loss(loss_fn: Callable[..., Any], output: Any, y: Any) -> torch.Tensor:
    """``loss_fn(output, y)`` (``loss_fn(output)`` without targets), checked to be a scalar,
    with output and targets of shapes that do not broadcast into a wrong loss."""
    if y is None:
        try:
            loss = loss_fn(output)
        except TypeError as exc:
            if not _needs_targets(loss_fn):
                raise
            raise LossError(
                f"loss function {_name(loss_fn)!r} needs targets, loss(output, y), but the "
                "source has no y; give the source targets (ArraySource(x, y), "
                "ZarrSource(store, x=..., y='name')), or use a loss of the output alone"
            ) from exc
    else:
        try:
            if (broadcast := _broadcast_shape(output, y)) is not None:
                loss = _call_watching_broadcast(loss_fn, output, y, broadcast)
            else:
                loss = loss_fn(output, y)
        except (RuntimeError, TypeError, AttributeError) as exc:
            error = output_type_error(loss_fn, output, exc) or float_label_error(
                loss_fn, output, y, exc
            )
            if error is None or isinstance(exc, DataflowError):
                raise
            raise error from exc
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossError(
            f"loss function {getattr(loss_fn, '__name__', loss_fn)!r} returned {shape}, "
            "not a scalar tensor; reduce it to the batch mean (e.g. reduction='mean')"
        )
    return loss


@dataclass(kw_only=True, frozen=True)
class ForwardConfig:
    model: Callable[[], torch.nn.Module]
    loss: Callable[..., torch.Tensor]
    # BatchNorm statistics over the global batch, reduced over the replicas
    # (stages.group_batchnorm); False: each replica's own local batch, as DDP without
    # SyncBatchNorm
    sync_batchnorm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sync_batchnorm, bool):
            raise ConfigError(
                f"sync_batchnorm={self.sync_batchnorm!r}: True (BatchNorm statistics over "
                "the global batch, reduced over the replicas) or False (each replica's own)"
            )
        if not callable(self.model):
            raise ConfigError(
                f"Forward(model=...): expected a model class or factory, got "
                f"{type(self.model).__name__}"
            )
        if not callable(self.loss):
            raise ConfigError(
                f"Forward(loss=...): expected a function (output, y) -> scalar tensor, got "
                f"{type(self.loss).__name__}"
            )


class Forward(Stage):
    """Runs ``loss(model(x), y)``; the model is built from the factory on each replica.

    ``model`` may be a factory (called with no arguments) or a module instance,
    which is deep-copied into each replica as the initial weights. ``sync_batchnorm``:
    every BatchNorm layer normalises with the global batch's statistics, reduced over
    the replicas each forward (and its adjoint each backward), exact for any split.
    """

    def __init__(
        self,
        model: Callable[[], torch.nn.Module] | torch.nn.Module,
        loss: Callable[..., torch.Tensor],
        *,
        name: str | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(name)
        if isinstance(model, torch.nn.Module):
            template = model
            model = lambda: copy.deepcopy(template)  # noqa: E731
        self.config = ForwardConfig(model=model, loss=loss, sync_batchnorm=sync_batchnorm)

    per_micro_batch = True

    @property
    def pairs_micro_batches(self) -> bool:  # (its BatchNorm reductions, see Stage)
        return self.config.sync_batchnorm

    def setup(self, replica: ReplicaContext) -> None:
        model = build_model(self.config.model, replica.seed)
        self._replicas = None
        if self.config.sync_batchnorm and replica.spatial is None:
            self._replicas = ReplicaGroup()
            self._warn_without_batchnorm(replica_batchnorm(model, self._replicas))
        if replica.spatial is not None:  # this worker computes its region of each sample
            model = replica.spatial.wrap_model(model)
            if self.config.sync_batchnorm:  # its BatchNorm layers reduce over the fit too
                self._replicas = ReplicaGroup()
                self._warn_without_batchnorm(join_batchnorm(model, self._replicas))
        precision, channels_last, compile_mode, allow_fp16, capture, simulate = (
            replica.requested_step_options
        )
        options = resolve_step_options(
            precision,
            channels_last,
            compile_mode,
            replica.device,
            model,
            spatial=replica.spatial is not None,
            allow_cpu_fp16=bool(allow_fp16),
            capture=bool(capture),
            simulate_capture=bool(simulate),
        )
        replica.step_options = options
        replica.loss_scale = LossScale() if options.precision == "fp16" else None
        model = model.to(replica.device)
        if (memory_format := options.torch_memory_format()) is not None:
            model = model.to(memory_format=memory_format)  # once: weights stay in it
        replica.model = model.train()
        self._compiled = CompiledModel(model, options.compile) if options.compile else None
        self._capture = None
        if options.capture is not None:
            self._capture = StepCapture(
                model,
                lambda x, y: self._loss_of(model, x, y),
                options,
                replica.device,
                simulate=options.capture == "simulated",
            )

    @staticmethod
    def _warn_without_batchnorm(layers: int) -> None:
        if not layers:
            warnings.warn(
                "sync_batchnorm=True, but the model has no BatchNorm layer: nothing to synchronise",
                RuntimeWarning,
                stacklevel=3,
            )

    def _sync_statistics(self, step: StepContext, replicas: ReplicaGroup) -> bool:
        """``sync_batchnorm``: the step's group for the model's BatchNorm layers; whether
        they reduce over other replicas in it."""
        replica = step.replica
        collective = replica.collective  # (every worker: a spatial layout's too)
        size = collective.world_size if collective is not None else 1
        replicas.collective, replicas.rank = collective, collective.rank if size > 1 else 0
        replicas.size = size
        replicas.share, replicas.global_batch = step.weight, step.global_batch
        replicas.replica = replica
        if size > 1:  # (paired: the k-th micro-batch of every replica; checked once a step)
            paired = step.spec.paired_micro_batches
            if step.micro_count > 1:
                replicas.global_batch = paired[step.micro_index]
        return size > 1

    def _take_part(self, step: StepContext, batch: Batch) -> ForwardOutput:
        """A replica without samples in this step still takes part in its peers'
        BatchNorm reductions: its model runs on the empty batch (zero rows in each
        reduction), and Backward runs the adjoint's reductions from a zero it holds."""
        options: StepOptions = step.replica.step_options or EAGER_FP32
        x = to_memory_format(batch.x, options.torch_memory_format())
        try:
            with autocast(step.replica.device, options):
                output = call_model(step.replica.model, x)
        except RuntimeError as exc:
            raise ModelError(
                f"sync_batchnorm=True: replica {step.replica.rank} has no samples in step "
                f"{step.spec.index}, and the model cannot run an empty batch, which it "
                "must to take part in the other replicas' BatchNorm statistics: "
                f"{str(exc).splitlines()[0]}. Let it take a batch of 0 samples, or use "
                "sync_batchnorm=False"
            ) from exc
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        zero = sum((t.sum() * 0.0 for t in tensors), torch.zeros((), device=x.device))
        return ForwardOutput(loss=None, output=None, batch=batch, participation=zero)

    def _loss_of(self, model: torch.nn.Module, x: Any, y: Any) -> tuple[torch.Tensor, Any]:
        """The captured step's forward and loss (the eager steps before it checked them)."""
        output = call_model(model, x)
        return compute_loss(self.config.loss, output, y), output

    def run(self, step: StepContext, batch: Batch) -> ForwardOutput:
        replicas = getattr(self, "_replicas", None)
        if replicas is not None and self._sync_statistics(step, replicas) and batch.size == 0:
            return self._take_part(step, batch)
        if batch.size == 0:  # this replica has no samples in this step
            return ForwardOutput(loss=None, output=None, batch=batch)
        capture = getattr(self, "_capture", None)
        if capture is not None and (replayed := capture.run(step, batch)) is not None:
            loss, output = replayed  # the gradients are on the parameters already
            if step.micro_count > 1:  # (a micro-batch's share of the local mean)
                step.metrics["loss"] = step.metrics.get("loss", 0.0) + loss
            else:
                step.metrics["loss"] = loss
            return ForwardOutput(loss=loss, output=output, batch=batch, captured=True)
        options: StepOptions = step.replica.step_options or EAGER_FP32
        x = to_memory_format(batch.x, options.torch_memory_format())
        compiled = getattr(self, "_compiled", None)
        try:
            with autocast(step.replica.device, options):
                output = compiled(x) if compiled is not None else call_model(step.replica.model, x)
                loss = compute_loss(self.config.loss, output, batch.y)
        except (RuntimeError, TypeError) as exc:  # torch's dtype errors name no input, no fix
            if isinstance(exc, DataflowError):  # already named (compute_loss's ModelError)
                raise
            mismatch = dtype_mismatch(step.replica.model, batch.x, exc)
            if mismatch is None:
                raise
            raise DataError(f"{mismatch}. torch said: {str(exc).splitlines()[0]}") from exc
        if step.micro_count > 1:  # accumulating: each micro-batch's share of the local mean
            loss = loss * step.micro_weight
            step.metrics["loss"] = step.metrics.get("loss", 0.0) + loss.detach()
        else:
            step.metrics["loss"] = loss.detach()
        return ForwardOutput(loss=loss, output=output, batch=batch)

    def begin_phase(self, replica: ReplicaContext, phase: PhaseContext) -> None:
        if getattr(self, "_capture", None) is not None:
            self._capture.reset()  # a new local batch: the last phase's graphs are done

    def end_phase(self, replica: ReplicaContext) -> dict[str, Any]:
        report: dict[str, Any] = {}
        for part in (getattr(self, "_compiled", None), getattr(self, "_capture", None)):
            if part is not None:
                report.update(part.phase_report())
        return report

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_compiled", None)  # worker-side: a compiled model never travels
        state.pop("_capture", None)  # nor its captured graphs
        return state
