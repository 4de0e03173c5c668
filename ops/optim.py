"""FusedSGD and FusedAdam: torch optimizers that update a whole param group in one launch.

At construction each param group's parameters (per dtype and device) move into one flat
contiguous buffer: every ``p.data`` becomes a view into it, and gradients and optimizer
state (momentum, exp_avg, exp_avg_sq) live in flat buffers of the same layout, so one
elementwise kernel (``ops/optim_kernels.py``) steps them all: ours (Numba), except for
SGD on CUDA, which is torch's fused SGD over the flat buffer. Everything else is
``torch.optim.Optimizer``: param groups, LR schedulers, hooks, and ``state_dict()``,
whose per-parameter state tensors are views of the flat buffers, keyed and named as
torch's (a checkpoint loads into ``torch.optim.SGD`` / ``AdamW`` and back).

Gradients: the first time a parameter has a ``.grad``, ``step()`` copies it into the
flat gradient buffer and rebinds ``p.grad`` to a view of it; autograd then accumulates
in place there. :meth:`zero_grad` zeroes the flat buffer and keeps the views (it does
not set grads to None by default: torch's ``set_to_none=False``). A ``.grad`` replaced
by another tensor (or a ``p.data`` replaced, e.g. by ``module.to``) is noticed by its
address and copied back in; a parameter whose ``.grad`` is None is skipped, as in torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
import torch

from dataflow.core.errors import ConfigError
from dataflow.ops.optim_kernels import ADAMW_STEP, SGD_STEP
from dataflow.ops.registry import Op, OpError, check, launch


class FlatParams:
    """The parameters of one param group with one dtype and device, as flat buffers.

    ``param`` and ``grad`` hold every parameter back to back; ``p.data`` is a view of
    ``param``. State buffers (``buffer(name)``) are allocated zeroed on first use.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        sizes = [p.numel() for p in params]
        self.offsets = [0, *np.cumsum(sizes, dtype=np.int64).tolist()]
        first = params[0]
        self.param = torch.empty(self.offsets[-1], dtype=first.dtype, device=first.device)
        self.grad = torch.zeros_like(self.param)
        self.buffers: dict[str, torch.Tensor] = {}
        self.param_views = self.views(self.param)
        self.grad_views = self.views(self.grad)
        with torch.no_grad():
            for p, view, gview in zip(params, self.param_views, self.grad_views, strict=True):
                view.copy_(p.detach())
                p.data = view
                if p.grad is not None:
                    gview.copy_(p.grad)
                    p.grad = gview

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat buffer, each shaped like its parameter."""
        o = self.offsets
        return [flat[o[i] : o[i + 1]].view(p.shape) for i, p in enumerate(self.params)]

    def buffer(self, name: str) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.zeros_like(self.param)
        return self.buffers[name]

    def span(self, first: int, stop: int) -> slice:
        """The elements of parameters ``first .. stop - 1``."""
        return slice(self.offsets[first], self.offsets[stop])

    def sync(self, owner: str) -> list[bool]:
        """Re-bind parameters and gradients that were replaced; which have a gradient."""
        has_grad = []
        for i, p in enumerate(self.params):
            view = self.param_views[i]
            if p.data_ptr() != view.data_ptr():
                self._rebind_param(i, owner)
            g = p.grad
            if g is None:
                has_grad.append(False)
                continue
            gview = self.grad_views[i]
            if g is not gview and (
                g.data_ptr() != gview.data_ptr() or g.stride() != gview.stride()
            ):
                if g.layout != torch.strided:
                    raise OpError(
                        f"{owner}: parameter {i} has a {g.layout} gradient; only dense "
                        "gradients are supported (use torch.optim.SparseAdam for sparse ones)"
                    )
                gview.copy_(g)
                p.grad = gview
            has_grad.append(True)
        return has_grad

    def _rebind_param(self, i: int, owner: str) -> None:
        p, view = self.params[i], self.param_views[i]
        if (p.shape, p.dtype, p.device) != (view.shape, view.dtype, view.device):
            raise ConfigError(
                f"{owner}: parameter {i} changed from {tuple(view.shape)} {view.dtype} on "
                f"{view.device} to {tuple(p.shape)} {p.dtype} on {p.device} after the "
                "optimizer was built; build the optimizer after moving or converting the model"
            )
        view.copy_(p.detach())
        p.data = view

    def zero_grad(self, set_to_none: bool) -> None:
        for i, p in enumerate(self.params):
            if set_to_none:
                p.grad = None
            elif p.grad is not None and p.grad is not self.grad_views[i]:
                p.grad = self.grad_views[i]
        if not set_to_none:
            self.grad.zero_()


def runs(keys: list[Any]) -> Iterator[tuple[int, int, Any]]:
    """Maximal runs ``(first, stop, key)`` of equal keys, skipping ``None`` (no gradient).

    Parameters in one run share one launch; usually the whole buffer is one run.
    """
    i, n = 0, len(keys)
    while i < n:
        if keys[i] is None:
            i += 1
            continue
        j = i + 1
        while j < n and keys[j] is not None and keys[j] == keys[i]:
            j += 1
        yield i, j, keys[i]
        i = j


def _real(
    owner: str,
    where: str,
    name: str,
    value: Any,
    *,
    low: float,
    high: float | None = None,
    high_open: bool = False,
) -> None:
    """Raise ConfigError naming ``name`` unless ``value`` is a finite real in range."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        bound = f">= {low}" if high is None else f"in [{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{owner}: {name}={value!r} in {where} must be a finite number {bound}")


class _FlatOptimizer(torch.optim.Optimizer):
    """What FusedSGD and FusedAdam share: flat buffers per group, grads, state loading."""

    op: ClassVar[Op]
    # options a subclass adds to its base's (set on the instance before __init__)
    _more_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self._flats: list[list[FlatParams]] = []
        super().__init__(params, {**defaults, **self._more_defaults})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            self._validate(group, f"param_groups[{index}]")
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in group["params"]:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            for same in by_kind.values():
                try:
                    check(self.op, same)
                except OpError as exc:
                    raise OpError(f"{type(self).__name__}: param_groups[{index}]: {exc}") from exc
        except ConfigError:
            self.param_groups.pop()
            raise
        self._flats.append([FlatParams(same) for same in by_kind.values()])

    def _validate(self, group: dict[str, Any], where: str) -> None:
        raise NotImplementedError

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every flat gradient buffer (one fill per buffer); ``.grad`` stay views.

        ``set_to_none=True`` sets them to None instead, as torch does; the next
        ``step()`` then copies autograd's new gradients into the flat buffer.
        """
        for flats in self._flats:
            for flat in flats:
                flat.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter with a gradient: one launch per flat buffer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, flats in zip(self.param_groups, self._flats, strict=True):
            for flat in flats:
                self._step(group, flat, flat.sync(type(self).__name__))
        return loss

    def _step(self, group: dict[str, Any], flat: FlatParams, has_grad: list[bool]) -> None:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of its torch counterpart (SGD / AdamW)."""
        for i, group in enumerate(state_dict["param_groups"]):
            self._validate({**self.defaults, **group}, f"the state_dict's param_groups[{i}]")
        super().load_state_dict(state_dict)
        for flats in self._flats:
            for flat in flats:
                self._adopt(flat)

    def _adopt(self, flat: FlatParams) -> None:
        """Copy loaded per-parameter state into the flat buffers; state becomes views."""
        raise NotImplementedError


class FusedSGD(_FlatOptimizer):
    """``torch.optim.SGD`` (momentum, dampening, weight decay, nesterov, maximize) with
    one kernel launch per param group and dtype/device.

    On the CPU the launch is our Numba kernel, bit for bit torch's default SGD. On CUDA
    it is torch's own fused kernel, ``torch.optim.SGD(fused=True)``'s, over the flat
    buffers (``optim_kernels.sgd_torch``): our Numba CUDA kernel lost to it on an H100
    in four of five runs of ``benchmarks/bench_gpu.py`` (torch time / ours on ResNet-50's
    parameters: 0.80, 0.85, 0.59, 1.20, 0.80) and was removed. State, ``state_dict`` and
    param groups are the same on both devices.
    """

    op = SGD_STEP

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            # torch.optim.SGD's own keys, so that it loads our state_dict as its own
            "foreach": None,
            "differentiable": False,
            "fused": None,
        }
        super().__init__(params, defaults)

    def _validate(self, group: dict[str, Any], where: str) -> None:
        name = "FusedSGD"
        _real(name, where, "lr", group["lr"], low=0)
        _real(name, where, "momentum", group["momentum"], low=0)
        _real(name, where, "dampening", group["dampening"], low=0, high=1)
        _real(name, where, "weight_decay", group["weight_decay"], low=0)
        for flag in ("nesterov", "maximize"):
            if not isinstance(group[flag], bool):
                raise ConfigError(f"{name}: {flag}={group[flag]!r} in {where} must be a bool")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ConfigError(
                f"{name}: nesterov=True in {where} needs momentum > 0 and dampening=0 (got "
                f"momentum={group['momentum']}, dampening={group['dampening']}); set them "
                "or use nesterov=False"
            )
        if group.get("differentiable"):
            raise ConfigError(
                f"{name}: differentiable=True in {where} is not supported; use torch.optim.SGD"
            )

    def _step(self, group: dict[str, Any], flat: FlatParams, has_grad: list[bool]) -> None:
        momentum = float(group["momentum"])
        if momentum != 0:
            buf = flat.buffer("momentum_buffer")
            keys = [
                ("momentum_buffer" in self.state.get(p, ())) if h else None
                for p, h in zip(flat.params, has_grad, strict=True)
            ]
        else:
            buf = None
            keys = [True if h else None for h in has_grad]
        for first, stop, initialized in runs(keys):
            span = flat.span(first, stop)
            launch(
                self.op,
                flat.param[span],
                flat.grad[span],
                buf[span] if buf is not None else flat.grad[span],  # unread without momentum
                inplace=(0, 2),
                lr=float(group["lr"]),
                weight_decay=float(group["weight_decay"]),
                momentum=momentum,
                dampening=float(group["dampening"]),
                nesterov=bool(group["nesterov"]),
                maximize=bool(group["maximize"]),
                first=not initialized,
            )
            if buf is not None and not initialized:
                views = flat.views(buf)
                for i in range(first, stop):
                    self.state[flat.params[i]]["momentum_buffer"] = views[i]

    def _adopt(self, flat: FlatParams) -> None:
        views = flat.views(flat.buffer("momentum_buffer"))
        for p, view in zip(flat.params, views, strict=True):
            state = self.state.get(p)
            loaded = state.get("momentum_buffer") if state else None
            if loaded is None:
                if state:
                    state.pop("momentum_buffer", None)
                continue
            view.copy_(loaded)
            state["momentum_buffer"] = view


class FusedAdam(_FlatOptimizer):
    """``torch.optim.AdamW``: Adam with decoupled weight decay and bias correction, with
    one kernel launch per param group and dtype/device (no amsgrad).

    Our Numba kernel on both devices: on an H100 it is at par with or ahead of
    ``torch.optim.AdamW(fused=True)`` (torch time / ours on ResNet-50's parameters:
    1.06, 1.47, 1.00, 1.05, 0.69 in five runs of ``benchmarks/bench_gpu.py``).
    """

    op = ADAMW_STEP

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            # torch.optim.AdamW's own keys, so that it loads our state_dict as its own
            "amsgrad": False,
            "maximize": maximize,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        }
        super().__init__(params, defaults)

    def _validate(self, group: dict[str, Any], where: str) -> None:
        name = "FusedAdam"
        _real(name, where, "lr", group["lr"], low=0)
        _real(name, where, "eps", group["eps"], low=0)
        _real(name, where, "weight_decay", group["weight_decay"], low=0)
        betas = group["betas"]
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ConfigError(f"{name}: betas={betas!r} in {where} must be a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            _real(name, where, f"betas[{i}]", beta, low=0, high=1, high_open=True)
        if not isinstance(group["maximize"], bool):
            raise ConfigError(f"{name}: maximize={group['maximize']!r} in {where} must be a bool")
        unsupported = {"amsgrad": "torch.optim.AdamW(amsgrad=True)", "differentiable": "AdamW"}
        for key, fix in unsupported.items():
            if group.get(key):
                raise ConfigError(f"{name}: {key}=True in {where} is not supported; use {fix}")
        if not group.get("decoupled_weight_decay", True) and group["weight_decay"] != 0:
            raise ConfigError(
                f"{name}: decoupled_weight_decay=False in {where} (torch.optim.Adam's L2 "
                "penalty) is not supported; FusedAdam is AdamW: load an AdamW state_dict"
            )

    def _steps(self, flat: FlatParams) -> torch.Tensor:
        """Per-parameter step counts, as torch keeps them (0-dim float tensors on the CPU)."""
        if "step" not in flat.buffers:
            dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            flat.buffers["step"] = torch.zeros(len(flat.params), dtype=dtype)
        return flat.buffers["step"]

    def _step(self, group: dict[str, Any], flat: FlatParams, has_grad: list[bool]) -> None:
        steps = self._steps(flat)
        counts = steps.numpy()
        m, v = flat.buffer("exp_avg"), flat.buffer("exp_avg_sq")
        keys = [int(counts[i]) if h else None for i, h in enumerate(has_grad)]
        beta1, beta2 = (float(b) for b in group["betas"])
        for first, stop, done in runs(keys):
            span = flat.span(first, stop)
            launch(
                self.op,
                flat.param[span],
                flat.grad[span],
                m[span],
                v[span],
                inplace=(0, 2, 3),
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                step=done + 1,
                maximize=bool(group["maximize"]),
            )
            counts[first:stop] = done + 1
            if done == 0:
                m_views, v_views = flat.views(m), flat.views(v)
                for i in range(first, stop):
                    self.state[flat.params[i]] = {
                        "step": steps[i],
                        "exp_avg": m_views[i],
                        "exp_avg_sq": v_views[i],
                    }

    def _adopt(self, flat: FlatParams) -> None:
        steps = self._steps(flat)
        m_views = flat.views(flat.buffer("exp_avg"))
        v_views = flat.views(flat.buffer("exp_avg_sq"))
        for i, p in enumerate(flat.params):
            state = self.state.get(p)
            if not state:
                steps[i] = 0
                m_views[i].zero_()
                v_views[i].zero_()
                continue
            steps[i] = float(state["step"])
            m_views[i].copy_(state["exp_avg"])
            v_views[i].copy_(state["exp_avg_sq"])
            state.update(step=steps[i], exp_avg=m_views[i], exp_avg_sq=v_views[i])
