"""The host work cut from each training step (issue 37, item 1; benchmarks/bench_step_host.py)
keeps every verdict and value it replaced."""

from __future__ import annotations

import pytest
import torch

from dataflow.ops import flat
from dataflow.ops.flat import grad_squared_norm
from stages.update import _finite, _finite_flag


def _model(dtype: torch.dtype, values: dict[int, float]) -> torch.nn.Module:
    """A model with fresh gradient buffers (as after each step's zero_grad), one empty."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(dtype)
    model.register_parameter("empty", torch.nn.Parameter(torch.zeros(0, dtype=dtype)))
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn(p.shape).to(dtype)
        if i in values and p.numel():
            p.grad.view(-1)[0] = values[i]
    return model


CASES = {
    "finite": (torch.float32, {}),
    "large but finite": (torch.float32, {0: 3e38, 2: -3e38}),
    "nan": (torch.float32, {1: float("nan")}),
    "inf": (torch.float32, {3: float("-inf")}),
    "bf16 large": (torch.bfloat16, {0: 3e38}),
    "bf16 nan": (torch.bfloat16, {2: float("nan")}),
    "fp16 inf": (torch.float16, {0: float("inf")}),
    "fp64 squares overflow": (torch.float64, {0: 1e200}),
    "fp64 finite": (torch.float64, {0: 1e100}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("loss", [1.5, float("nan"), None])
def test_the_single_replica_check_gives_the_squared_norms_verdict(case, loss):
    dtype, values = CASES[case]
    model = _model(dtype, values)
    loss_t = None if loss is None else torch.tensor(loss)
    grads = [p.grad for p in model.parameters()]
    # the squared norm in float64 (grad_squared_norm's; its kernel takes float32/64 only)
    norm = sum(g.double().pow(2).sum() for g in grads)
    if dtype in (torch.float32, torch.float64):
        assert torch.equal(norm.isfinite(), grad_squared_norm(grads).isfinite())
    expected = bool(torch.isfinite(norm + (0.0 if loss is None else loss_t.double())))
    assert _finite(loss_t, None, model) is expected
    assert bool(_finite_flag(loss_t, None, model)) is expected


def test_the_single_replica_check_builds_no_plan_per_step():
    """Each step's gradients are new buffers: a squared-norm plan built for them (an
    arena over their addresses, a chunk table) was rebuilt every step."""
    plans = dict(flat._PLANS)
    for _ in range(3):
        assert _finite(torch.tensor(1.0), None, _model(torch.float32, {}))
    assert plans == flat._PLANS
