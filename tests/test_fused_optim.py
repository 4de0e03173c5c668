"""FusedSGD and FusedAdam train exactly as torch.optim.SGD / AdamW and behave as
torch optimizers: param groups, state_dict both ways, zero_grad, replaced and missing
gradients, one kernel launch per group.

Precision: SGD is compared in float32 (it is bit-identical to torch on CPU: same FMAs);
AdamW in float64 to 1e-6 relative, and in float32 to 1e-5 of each tensor's largest
value (torch's vectorized float32 sqrt is not correctly rounded on AVX-512 CPUs, and
Adam's normalisation magnifies such last-bit differences where gradients are tiny).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import TinyCNN

from dataflow.errors import ConfigError
from dataflow.ops import optim
from dataflow.ops.optim import FusedAdam, FusedSGD
from dataflow.ops.registry import OpError

STEPS = 50
SGD_CONFIGS = {
    "plain": dict(lr=0.05),
    "momentum+decay": dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
    "nesterov+decay": dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "dampening+maximize": dict(lr=0.05, momentum=0.8, dampening=0.2, maximize=True),
}


def batches(n: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield (
            torch.randn(16, 1, 8, 8, generator=g, dtype=dtype),
            torch.randint(3, (16,), generator=g),
        )


def loss_of(model, x, y, maximize=False):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return -loss if maximize else loss


def train(model, opt, data, *, maximize=False):
    for x, y in data:
        opt.zero_grad()
        loss_of(model, x, y, maximize).backward()
        opt.step()
    return model


def new_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return TinyCNN().to(dtype)


def assert_same_params(a, b, *, rtol, atol=0.0, scale_relative=False):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if scale_relative:  # relative to the tensor's largest magnitude
            atol = rtol * pb.abs().max().item()
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("config", sorted(SGD_CONFIGS))
def test_fused_sgd_matches_torch_sgd_over_50_steps(config):
    kw = SGD_CONFIGS[config]
    maximize = kw.get("maximize", False)
    ours = new_model()
    train(ours, FusedSGD(ours.parameters(), **kw), batches(STEPS, torch.float32), maximize=maximize)
    theirs = new_model()
    opt = torch.optim.SGD(theirs.parameters(), **kw)
    train(theirs, opt, batches(STEPS, torch.float32), maximize=maximize)
    assert_same_params(ours, theirs, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    ("dtype", "check"),
    [
        (torch.float64, dict(rtol=1e-6, atol=1e-12)),
        (torch.float32, dict(rtol=1e-5, scale_relative=True)),
    ],
)
def test_fused_adam_matches_torch_adamw_over_50_steps(dtype, check):
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    ours = new_model(dtype)
    train(ours, FusedAdam(ours.parameters(), **kw), batches(STEPS, dtype))
    theirs = new_model(dtype)
    train(theirs, torch.optim.AdamW(theirs.parameters(), **kw), batches(STEPS, dtype))
    assert_same_params(ours, theirs, **check)


def groups(model, lr):
    convs = [*model.conv.parameters(), *model.conv2.parameters()]
    return [{"params": convs, "lr": lr}, {"params": model.head.parameters()}]


@pytest.mark.parametrize(
    ("ours", "theirs", "dtype"),
    [
        (FusedSGD, torch.optim.SGD, torch.float32),
        (FusedAdam, torch.optim.AdamW, torch.float64),
    ],
)
def test_two_param_groups_with_their_own_lr_launch_once_each(ours, theirs, dtype, monkeypatch):
    launches = []
    real_launch = optim.launch
    monkeypatch.setattr(
        optim, "launch", lambda *a, **k: launches.append(k["lr"]) or real_launch(*a, **k)
    )
    a, b = new_model(dtype), new_model(dtype)
    opt = ours(groups(a, 0.1), lr=0.01, weight_decay=1e-3)
    train(a, opt, batches(10, dtype))
    train(b, theirs(groups(b, 0.1), lr=0.01, weight_decay=1e-3), batches(10, dtype))
    assert_same_params(a, b, rtol=1e-6, atol=1e-12)
    assert launches == [0.1, 0.01] * 10  # one kernel per group and step
    # each group's parameters are views of one flat buffer
    for group in opt.param_groups:
        storages = {p.untyped_storage().data_ptr() for p in group["params"]}
        assert len(storages) == 1


def roundtrip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize(
    ("ours", "theirs", "kw", "dtype"),
    [
        (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3), torch.float32),
        (FusedAdam, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05), torch.float64),
    ],
)
def test_state_dict_round_trips_through_torch_and_back(ours, theirs, kw, dtype):
    data = list(batches(30, dtype))
    reference = new_model(dtype)
    train(reference, theirs(reference.parameters(), **kw), data)

    # ours for 10 steps -> torch for 10 steps -> ours for 10 steps == torch for 30
    model = new_model(dtype)
    first = ours(model.parameters(), **kw)
    train(model, first, data[:10])
    saved = roundtrip(first.state_dict())
    expected = roundtrip(theirs(new_model(dtype).parameters(), **kw).state_dict())
    assert saved["param_groups"] == [{**expected["param_groups"][0], **saved["param_groups"][0]}]
    assert set(saved["param_groups"][0]) == set(expected["param_groups"][0])
    for key, state in saved["state"].items():
        assert list(state) == list(first.state[list(model.parameters())[key]])

    middle = theirs(model.parameters(), **kw)
    middle.load_state_dict(saved)
    train(model, middle, data[10:20])

    last = ours(model.parameters(), **kw)
    last.load_state_dict(roundtrip(middle.state_dict()))
    train(model, last, data[20:])
    assert_same_params(model, reference, rtol=1e-6, atol=1e-12)
    # the loaded state lives in the flat buffers: state_dict shows the trained values
    assert last.state_dict()["state"].keys() == middle.state_dict()["state"].keys()


def test_our_state_dict_loads_into_a_fresh_fused_optimizer():
    data = list(batches(20, torch.float32))
    a, b = new_model(), new_model()
    opt_a = FusedSGD(a.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    train(a, opt_a, data[:10])
    b.load_state_dict(a.state_dict())
    opt_b = FusedSGD(b.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    train(a, opt_a, data[10:])
    train(b, opt_b, data[10:])
    assert_same_params(a, b, rtol=0, atol=0)


def test_zero_grad_keeps_grads_as_views_and_accumulation_works():
    ours, theirs = new_model(), new_model()
    opt = FusedSGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    data = list(batches(12, torch.float32))
    for i in range(0, 12, 2):  # two backward passes accumulate into one step
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            for x, y in data[i : i + 2]:
                loss_of(model, x, y).backward()
            o.step()
        pointers = [p.grad.data_ptr() for p in ours.parameters()]
        opt.zero_grad()
        assert [p.grad.data_ptr() for p in ours.parameters()] == pointers
        assert all(p.grad.eq(0).all() for p in ours.parameters())
    assert_same_params(ours, theirs, rtol=0, atol=0)
    # the grads are views of the flat buffer, after the first step at least
    flat = opt._flats[0][0]
    base, end = flat.grad.data_ptr(), flat.grad.data_ptr() + flat.grad.numel() * 4
    assert all(base <= p.grad.data_ptr() < end for p in ours.parameters())


def test_zero_grad_set_to_none_is_honoured():
    ours, theirs = new_model(), new_model()
    opt = FusedAdam(ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for x, y in batches(5, torch.float32):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad(set_to_none=True)
            assert all(p.grad is None for p in model.parameters())
            loss_of(model, x, y).backward()
            o.step()
    assert_same_params(ours, theirs, rtol=1e-5, scale_relative=True)


def test_a_replaced_grad_and_a_replaced_param_are_honoured():
    ours, theirs = new_model(), new_model()
    opt = FusedSGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for step, (x, y) in enumerate(batches(6, torch.float32)):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            loss_of(model, x, y).backward()
            head = model.head.weight
            head.grad = head.grad * 3.0  # a new tensor, not a view of the flat buffer
            if step == 3:
                with torch.no_grad():
                    model.conv.bias.data = model.conv.bias.data + 1.0  # a new tensor
            o.step()
    assert_same_params(ours, theirs, rtol=0, atol=0)


def test_a_param_without_grad_is_skipped_like_torch():
    """``extra`` gets no gradient for 3 steps (untouched, no state), then joins in."""

    def run(make):
        model = new_model()
        extra = torch.nn.Parameter(torch.ones(5))
        opt = make([*model.parameters(), extra])
        states = []
        for step, (x, y) in enumerate(batches(6, torch.float32)):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            if step >= 3:
                loss = loss + extra.square().sum()
            loss.backward()
            opt.step()
            states.append(extra.detach().clone())
            if step < 3:
                assert extra.grad is None and extra not in opt.state
        return model, states

    for ours, theirs in [
        (
            lambda p: FusedSGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
        ),
        (lambda p: FusedAdam(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
    ]:
        (a, extra_a), (b, extra_b) = run(ours), run(theirs)
        assert all(e.eq(1).all() for e in extra_a[:3])
        torch.testing.assert_close(torch.stack(extra_a), torch.stack(extra_b), rtol=1e-6, atol=0)
        assert_same_params(a, b, rtol=1e-5, scale_relative=True)


def test_mixed_dtypes_in_a_group_get_one_flat_buffer_each():
    a = torch.nn.Parameter(torch.randn(4))
    b = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    ta, tb = (torch.nn.Parameter(t.detach().clone()) for t in (a, b))
    opt = FusedSGD([a, b], lr=0.1, momentum=0.5, weight_decay=1e-3)
    ref = torch.optim.SGD([ta, tb], lr=0.1, momentum=0.5, weight_decay=1e-3)
    for _ in range(3):
        for params, o in (((a, b), opt), ((ta, tb), ref)):
            o.zero_grad()
            (params[0].sum() + params[1].square().sum()).backward()
            o.step()
    assert len(opt._flats[0]) == 2
    torch.testing.assert_close((a, b), (ta, tb), rtol=0, atol=0)


def test_lr_scheduler_changes_are_used():
    ours, theirs = new_model(), new_model()
    opt = FusedSGD(ours.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref)]
    for x, y in batches(6, torch.float32):
        for model, o, s in ((ours, opt, scheds[0]), (theirs, ref, scheds[1])):
            o.zero_grad()
            loss_of(model, x, y).backward()
            o.step()
            s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0125)
    assert_same_params(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: FusedSGD(p, lr=-0.1),
            r"FusedSGD: lr=-0.1 in param_groups\[0\] must be a finite",
        ),
        (lambda p: FusedSGD(p, lr=0.1, momentum=-1), "momentum=-1 .* >= 0"),
        (lambda p: FusedSGD(p, lr=0.1, dampening=2), r"dampening=2 .* in \[0, 1\]"),
        (lambda p: FusedSGD(p, lr=0.1, nesterov=True), "nesterov=True .* needs momentum > 0"),
        (lambda p: FusedSGD(p, lr=float("nan")), "lr=nan"),
        (lambda p: FusedSGD(p, lr="0.1"), "lr='0.1'"),
        (lambda p: FusedAdam(p, lr=-1e-3), "FusedAdam: lr=-0.001"),
        (lambda p: FusedAdam(p, betas=(0.9, 1.0)), r"betas\[1\]=1.0 .* in \[0, 1\)"),
        (lambda p: FusedAdam(p, betas=(-0.1, 0.9)), r"betas\[0\]=-0.1"),
        (lambda p: FusedAdam(p, betas=0.9), "betas=0.9 .* must be a pair"),
        (lambda p: FusedAdam(p, eps=-1e-8), "eps=-1e-08"),
        (lambda p: FusedAdam(p, weight_decay=-0.01), "weight_decay=-0.01"),
        (
            lambda p: FusedSGD([{"params": p[:1]}, {"params": p[1:], "lr": -1}], lr=0.1),
            r"lr=-1 in param_groups\[1\]",
        ),
    ],
)
def test_bad_hyperparameters_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make(list(TinyCNN().parameters()))


def test_a_torch_adam_l2_or_amsgrad_state_is_refused():
    model = new_model()
    opt = FusedAdam(model.parameters())
    for other in (torch.optim.Adam(model.parameters(), weight_decay=0.1),
                  torch.optim.AdamW(model.parameters(), amsgrad=True)):  # fmt: skip
        with pytest.raises(ConfigError, match=r"FusedAdam: (decoupled_weight_decay|amsgrad)"):
            opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam])
def test_unsupported_param_dtypes_are_refused_by_name(cls, dtype):
    params = [torch.nn.Parameter(torch.zeros(3, dtype=dtype))]
    message = f"{cls.__name__}: param_groups\\[0\\]: {cls.op.name}: dtype {dtype} is not supported"
    with pytest.raises(OpError, match=message + "; supported: dtypes float32, float64"):
        cls(params, lr=0.1)


def test_a_param_moved_after_construction_is_named():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = FusedSGD([p], lr=0.1)
    p.data = torch.zeros(3, dtype=torch.float64)
    p.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"parameter 0 changed from .* build the optimizer after"):
        opt.step()
