"""The host work cut from each training step (issue 37, item 1; benchmarks/bench_step_host.py)
keeps every verdict and value it replaced."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dataflow.core import digest
from dataflow.core.digest import add_digests, sample_digest
from dataflow.core.errors import LossError, NonFiniteError
from dataflow.core.step import ReplicaContext, StepContext, StepSpec
from dataflow.ops import flat
from dataflow.ops.flat import grad_squared_norm
from dataflow.runtime.window_parts import WindowTally
from dataflow.stages.forward import compute_loss
from dataflow.stages.update import _finite, _finite_flag


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
    params = list(model.parameters())
    assert _finite(loss_t, None, params) is expected
    assert bool(_finite_flag(loss_t, None, params)) is expected


def test_the_single_replica_check_builds_no_plan_per_step():
    """Each step's gradients are new buffers: a squared-norm plan built for them (an
    arena over their addresses, a chunk table) was rebuilt every step."""
    plans = dict(flat._PLANS)
    for _ in range(3):
        model = _model(torch.float32, {})
        assert _finite(torch.tensor(1.0), None, list(model.parameters()))
    assert plans == flat._PLANS


def test_a_phase_asks_torch_whether_its_loss_shapes_broadcast_once():
    """torch answers a pair that does not broadcast (class logits and labels) with an
    exception: once per shape pair, not once per step."""
    calls = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is torch.broadcast_shapes.__code__:
            calls.append(frame.f_code.co_name)

    logits, labels = torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])
    sys.setprofile(watch)
    try:
        losses = [compute_loss(F.cross_entropy, logits, labels) for _ in range(3)]
    finally:
        sys.setprofile(None)
    assert torch.equal(losses[0], F.cross_entropy(logits, labels))
    assert len(calls) <= 1


def test_a_shape_pair_that_broadcasts_wider_is_still_refused_every_time():
    for _ in range(2):
        with pytest.raises(LossError, match=r"broadcast to \(4, 4\)"):
            compute_loss(F.mse_loss, torch.randn(4, 1), torch.randn(4))


@pytest.mark.parametrize(
    "reads",
    [
        [np.array([3, 1, 4]), torch.tensor([1, 5]), np.array([], dtype=np.int64)],
        [np.array([], dtype=np.int64)],
        [],
    ],
)
def test_a_windows_digest_is_the_sum_of_its_steps_digests(reads):
    tally = WindowTally(0, max(1, len(reads)))
    spec = StepSpec(0, 0, 0, 0, 8, (8,), False)
    for indices in reads:
        tally.add(StepContext(ReplicaContext(0, 1, torch.device("cpu"), 0), spec,
                              metrics={"sample_indices": indices}), 0.0)  # fmt: skip
    expected = None
    for indices in reads:
        expected = add_digests(expected or 0, sample_digest(np.asarray(indices)))
    assert tally.digest == expected
    assert tally.read == sum(len(i) for i in reads)


def test_a_window_hashes_its_samples_once():
    """The digest's numpy calls ran in every step; the window sums them at its end."""
    calls = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is digest.index_hashes.__code__:
            calls.append(1)

    tally = WindowTally(0, 4)
    sys.setprofile(watch)
    try:
        for i in range(4):
            spec = StepSpec(i, 0, i, 8 * i, 8, (8,), False)
            metrics = {"sample_indices": np.arange(8 * i, 8 * i + 8)}
            tally.add(StepContext(ReplicaContext(0, 1, torch.device("cpu"), 0), spec,
                                  metrics=metrics), 0.0)  # fmt: skip
        value = tally.digest
    finally:
        sys.setprofile(None)
    assert value == sample_digest(np.arange(32))
    assert len(calls) == 1


def test_the_update_lists_the_models_parameters_once_not_every_step():
    """The single-replica check reads every parameter's gradient each step; walking the
    module tree for them (``model.parameters()``) cost 0.24 ms of host time a step on
    ResNet-50. The list is made once per model; the verdicts are unchanged."""
    from dataflow.core.batch import Gradients
    from dataflow.stages.update import Update

    class Counted(torch.nn.Sequential):
        walks = 0

        def parameters(self, recurse: bool = True):
            Counted.walks += 1
            return super().parameters(recurse)

    model = Counted(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    replica = ReplicaContext(rank=0, world_size=1, device=torch.device("cpu"), seed=0, model=model)
    update = Update(lambda params: torch.optim.SGD(params, lr=0.1))
    update.setup(replica)
    walks = Counted.walks
    for index in range(5):
        spec = StepSpec(
            index=index,
            epoch=0,
            step_in_epoch=index,
            start=8 * index,
            global_batch=8,
            local_batches=(8,),
            last_in_epoch=False,
        )
        step = StepContext(replica=replica, spec=spec)
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        step.metrics["loss"] = loss.detach()
        update.run(step, Gradients(samples=8, reduced=True))
    assert Counted.walks - walks == 1
    bad = model(torch.full((8, 4), float("nan"))).sum()  # a non-finite step still fails
    bad.backward()
    step = StepContext(replica=replica, spec=spec)
    step.metrics["loss"] = bad.detach()
    with pytest.raises(NonFiniteError, match="non-finite loss or gradient at step 4"):
        update.run(step, Gradients(samples=8, reduced=True))
