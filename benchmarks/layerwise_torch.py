"""LARS and LAMB written in torch as a user would, to time FusedLARS / FusedLAMB against.

torch has neither optimizer. ``foreach`` is the fastest torch form we know: per-tensor
norms from ``torch._foreach_norm``, the ratios as one small tensor (no host read), the
update in ``_foreach_*`` calls. ``loop`` is the per-tensor form of timm's ``Lars`` and
most LAMB ports. Both follow ``dataflow.ops.layerwise_kernels``' references (the same
arithmetic, to rounding; ``exclude_1d`` as ours).
"""

from __future__ import annotations

from typing import Any

import torch


def _split(params: list[torch.Tensor], exclude_1d: bool) -> tuple[list, list]:
    adapted = [p for p in params if not (exclude_1d and p.dim() <= 1)]
    plain = [p for p in params if exclude_1d and p.dim() <= 1]
    return adapted, plain


class TorchLARS(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, exclude_1d: bool = False,
                 foreach: bool = True) -> None:  # fmt: skip
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps))  # fmt: skip
        self.exclude_1d, self.foreach = exclude_1d, foreach

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            if self.foreach:
                self._foreach(group, params)
            else:
                self._loop(group, params)

    def _foreach(self, group: dict, params: list[torch.Tensor]) -> None:
        wd, mu, lr = group["weight_decay"], group["momentum"], group["lr"]
        adapted, plain = _split(params, self.exclude_1d)
        grads = [p.grad for p in adapted]
        w = torch.stack(torch._foreach_norm(adapted))
        g = torch.stack(torch._foreach_norm(grads))
        ratio = group["trust_coefficient"] * w / (g + wd * w + group["eps"])
        ratio = torch.where((w > 0) & (g > 0), ratio, torch.ones_like(ratio))
        d = list(torch._foreach_add(grads, adapted, alpha=wd))
        torch._foreach_mul_(d, list(ratio.unbind()))
        d += [p.grad for p in plain]
        bufs = [self.state[p]["momentum_buffer"] for p in adapted + plain]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, d)
        torch._foreach_add_(adapted + plain, bufs, alpha=-lr)

    def _loop(self, group: dict, params: list[torch.Tensor]) -> None:
        wd, mu, lr, tc = (group[k] for k in ("weight_decay", "momentum", "lr", "trust_coefficient"))
        for p in params:
            d = p.grad
            if not (self.exclude_1d and p.dim() <= 1):
                w, g = p.norm(), d.norm()
                ratio = torch.where((w > 0) & (g > 0), tc * w / (g + wd * w + group["eps"]), 1.0)
                d = d.add(p, alpha=wd).mul_(ratio)
            buf = self.state[p]["momentum_buffer"]
            buf.mul_(mu).add_(d)
            p.add_(buf, alpha=-lr)


class TorchLAMB(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, exclude_1d: bool = False,
                 foreach: bool = True) -> None:  # fmt: skip
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.exclude_1d, self.foreach, self.steps = exclude_1d, foreach, 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.steps += 1
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p].update(
                        exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
            if self.foreach:
                self._foreach(group, params)
            else:
                for p in params:
                    self._one(group, p)

    def _moments(self, group: dict, params: list) -> tuple[list, list]:
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        bc1, bc2_sqrt = 1 - beta1**self.steps, (1 - beta2**self.steps) ** 0.5
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, group["eps"])
        u = list(torch._foreach_div(m, bc1))
        torch._foreach_div_(u, denom)
        return u, params

    def _foreach(self, group: dict, params: list[torch.Tensor]) -> None:
        adapted, plain = _split(params, self.exclude_1d)
        u, _ = self._moments(group, adapted + plain)
        ua, up = u[: len(adapted)], u[len(adapted) :]
        if adapted:
            torch._foreach_add_(ua, adapted, alpha=group["weight_decay"])
            w = torch.stack(torch._foreach_norm(adapted))
            n = torch.stack(torch._foreach_norm(ua))
            ratio = torch.where((w > 0) & (n > 0), w / n, torch.ones_like(w))
            torch._foreach_mul_(ua, list((-group["lr"] * ratio).unbind()))
            torch._foreach_add_(adapted, ua)
        if plain:
            torch._foreach_add_(plain, up, alpha=-group["lr"])

    def _one(self, group: dict, p: torch.Tensor) -> None:
        (u,), _ = self._moments(group, [p])
        if self.exclude_1d and p.dim() <= 1:
            p.add_(u, alpha=-group["lr"])
            return
        u.add_(p, alpha=group["weight_decay"])
        w, n = p.norm(), u.norm()
        ratio = torch.where((w > 0) & (n > 0), w / n, 1.0)
        p.add_(u * ratio, alpha=-group["lr"])
