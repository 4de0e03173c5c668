"""FusedLARS and FusedLAMB: the per-tensor torch definitions (``layerwise_kernels``'s
references) to float rounding, the trust ratio's behaviour, torch-optimizer manners
(groups, state dicts, bad options named), and in a fit on the cluster."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyCNN, make_data, max_abs_diff, reference_training, tiny_pipeline
from test_fused_optim import batches, new_model

import dataflow as dfl
from dataflow.errors import ConfigError
from dataflow.ops import FusedAdam, FusedLAMB, FusedLARS, FusedSGD, layerwise
from dataflow.ops.layerwise_kernels import lamb_reference, lars_reference
from dataflow.schedule import lr_at

STEPS = 30


def grads_of(model, x, y, scale=1.0):
    for p in model.parameters():
        p.grad = None
    (torch.nn.functional.cross_entropy(model(x), y) * scale).backward()
    return [p.grad for p in model.parameters()]


def train_fused(model, opt, data, scale=1.0):
    for x, y in data:
        opt.zero_grad()
        (torch.nn.functional.cross_entropy(model(x), y) * scale).backward()
        opt.step()
    return model


def train_reference(model, kind, kw, data, *, exclude_1d=True):
    """The per-tensor torch definition, step by step, on ``model`` in place."""
    params = list(model.parameters())
    adapt = [not (exclude_1d and p.dim() <= 1) for p in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    for step, (x, y) in enumerate(data, start=1):
        grads = grads_of(model, x, y)
        with torch.no_grad():
            weights = [p.detach().clone() for p in params]
            if kind == "lars":
                new, state[0] = lars_reference(
                    weights, grads, state[0], adapt, **kw, first=step == 1
                )
            else:
                new, *state = lamb_reference(weights, grads, *state, adapt, **kw, step=step)
            for p, value in zip(params, new, strict=True):
                p.copy_(value)
    return model


LARS_CONFIGS = {
    "momentum+decay": dict(lr=0.5, momentum=0.9, dampening=0.0, weight_decay=1e-3),
    "nesterov": dict(lr=0.5, momentum=0.9, dampening=0.0, weight_decay=1e-3, nesterov=True),
    "no-momentum": dict(lr=2.0, momentum=0.0, dampening=0.0, weight_decay=0.0),
    "dampening": dict(lr=0.5, momentum=0.8, dampening=0.2, weight_decay=5e-4),
}
LARS_DEFAULTS = dict(nesterov=False, trust_coefficient=0.02, eps=1e-8)
LAMB_CONFIGS = {
    "decay": dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01),
    "lerp-from-end": dict(lr=0.01, beta1=0.3, beta2=0.9, eps=1e-8, weight_decay=0.0),
}


def _lars(params, cfg, **more):
    return FusedLARS(params, **{**LARS_DEFAULTS, **cfg}, **more)


def _lamb(params, cfg, **more):
    kw = dict(cfg)
    betas = (kw.pop("beta1"), kw.pop("beta2"))
    return FusedLAMB(params, betas=betas, **kw, **more)


@pytest.mark.parametrize("chunk", [1 << 14, 7])  # one chunk per tensor; many per tensor
@pytest.mark.parametrize("exclude_1d", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("kind", "config"),
    [("lars", c) for c in sorted(LARS_CONFIGS)] + [("lamb", c) for c in sorted(LAMB_CONFIGS)],
)
def test_fused_steps_match_the_per_tensor_definition(
    kind, config, dtype, exclude_1d, chunk, monkeypatch
):
    monkeypatch.setattr(layerwise, "CPU_CHUNK", chunk)
    cfg = (LARS_CONFIGS if kind == "lars" else LAMB_CONFIGS)[config]
    make = _lars if kind == "lars" else _lamb
    ours = new_model(dtype)
    train_fused(ours, make(ours.parameters(), cfg, exclude_1d=exclude_1d), batches(STEPS, dtype))
    kw = {**LARS_DEFAULTS, **cfg} if kind == "lars" else cfg
    theirs = train_reference(
        new_model(dtype), kind, kw, batches(STEPS, dtype), exclude_1d=exclude_1d
    )
    # the norms are summed in another order: ratios agree to rounding, not bit for bit
    rtol = 1e-5 if dtype == torch.float32 else 1e-11
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item(), msg=name)
    assert max_abs_diff(ours, new_model(dtype)) > 1e-3  # it trained


def test_lars_steps_do_not_depend_on_the_gradients_scale():
    """The trust ratio makes an adapted tensor's step independent of the gradient's
    magnitude (up to eps and weight decay), where SGD's grows with it: the point of
    LARS when the batch, and with it the LR, grows."""

    def first_step(make, scale):
        model = new_model(torch.float64)
        before = [p.detach().clone() for p in model.parameters()]
        train_fused(model, make(model.parameters()), batches(1, torch.float64), scale=scale)
        return [
            (p.detach() - b).norm().item() for p, b in zip(model.parameters(), before, strict=True)
        ]

    lars = lambda p: FusedLARS(  # noqa: E731
        p, lr=1.0, momentum=0.0, trust_coefficient=0.01, eps=0, exclude_1d=True
    )
    sgd = lambda p: FusedSGD(p, lr=1.0)  # noqa: E731
    small, large = first_step(lars, 1.0), first_step(lars, 1000.0)
    dims = [p.dim() for p in new_model().parameters()]
    weights = [p.norm().item() for p in new_model(torch.float64).parameters()]
    for d, s, big, w in zip(dims, small, large, weights, strict=True):
        if d > 1:  # adapted: a step of lr * trust_coefficient * |w|, whatever the scale
            assert s == pytest.approx(0.01 * w, rel=1e-9)
            assert big == pytest.approx(s, rel=1e-9)
        else:  # a bias: SGD's step, 1000x larger
            assert big == pytest.approx(1000 * s, rel=1e-6)
    sgd_small, sgd_large = first_step(sgd, 1.0), first_step(sgd, 1000.0)
    assert sgd_large[0] == pytest.approx(1000 * sgd_small[0], rel=1e-6)


def test_a_tensor_with_zero_weights_takes_the_plain_step():
    """|w| = 0 (a layer initialised to zeros) gives ratio 1, as in the papers: the
    first step is SGD's plus the (zero) decay, not a zero step forever."""
    model = new_model(torch.float64)
    sgd_model = new_model(torch.float64)
    with torch.no_grad():
        model.head.weight.zero_()
        sgd_model.head.weight.zero_()
    lars = FusedLARS(model.parameters(), lr=0.1, momentum=0.0, weight_decay=1e-2)
    sgd = FusedSGD(sgd_model.parameters(), lr=0.1)
    train_fused(model, lars, batches(1, torch.float64))
    train_fused(sgd_model, sgd, batches(1, torch.float64))
    assert model.head.weight.abs().max() > 0
    torch.testing.assert_close(model.head.weight, sgd_model.head.weight, rtol=1e-12, atol=0)


def test_exclude_1d_gives_biases_the_plain_step_without_decay():
    model, plain = new_model(torch.float64), new_model(torch.float64)
    opt = FusedLARS(model.parameters(), lr=0.3, momentum=0.9, weight_decay=0.1, exclude_1d=True)
    ref = torch.optim.SGD(plain.parameters(), lr=0.3, momentum=0.9)  # no decay
    train_fused(model, opt, batches(1, torch.float64))
    train_fused(plain, ref, batches(1, torch.float64))
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        if a.dim() <= 1:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=name)
        else:
            assert (a - b).abs().max() > 1e-6, name


def test_param_groups_keep_their_own_options():
    model = new_model(torch.float64)
    params = list(model.parameters())
    groups = [
        {"params": params[:2], "trust_coefficient": 0.05},
        {"params": params[2:], "lr": 0.05, "exclude_1d": True},
    ]
    opt = FusedLARS(groups, lr=0.5, momentum=0.9, weight_decay=1e-3)
    assert [g["trust_coefficient"] for g in opt.param_groups] == [0.05, 0.001]
    assert [g["exclude_1d"] for g in opt.param_groups] == [False, True]
    train_fused(model, opt, batches(STEPS, torch.float64))

    reference = new_model(torch.float64)
    ref_params = list(reference.parameters())
    bufs = [torch.zeros_like(p) for p in ref_params]
    options = [
        dict(lr=0.5, trust_coefficient=0.05, exclude_1d=False),
        dict(lr=0.05, trust_coefficient=0.001, exclude_1d=True),
    ]
    for step, (x, y) in enumerate(batches(STEPS, torch.float64)):
        grads = grads_of(reference, x, y)
        with torch.no_grad():
            for span, o in ((slice(0, 2), options[0]), (slice(2, None), options[1])):
                ps = [p.detach().clone() for p in ref_params[span]]
                adapt = [not (o["exclude_1d"] and p.dim() <= 1) for p in ps]
                new, bufs[span] = lars_reference(
                    ps, grads[span], bufs[span], adapt, lr=o["lr"], momentum=0.9,
                    dampening=0.0, weight_decay=1e-3, nesterov=False,
                    trust_coefficient=o["trust_coefficient"], eps=1e-8, first=step == 0,
                )  # fmt: skip
                for p, value in zip(ref_params[span], new, strict=True):
                    p.copy_(value)
    assert max_abs_diff(model, reference) <= 1e-11


def test_lr_scheduler_changes_are_used():
    model, reference = new_model(torch.float64), new_model(torch.float64)
    opt = FusedLAMB(model.parameters(), lr=0.02)
    ref = FusedLAMB(reference.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    for step, (x, y) in enumerate(batches(9, torch.float64)):
        for o, m in ((opt, model), (ref, reference)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
        if step and step % 3 == 0:  # StepLR's chained form
            ref.param_groups[0]["lr"] *= 0.1
        opt.step()
        ref.step()
        scheduler.step()
    assert max_abs_diff(model, reference) == 0.0


@pytest.mark.parametrize(
    ("make_before", "make_after"),
    [
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9), lambda p: FusedLARS(p, lr=0.1)),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: FusedLARS(p, lr=0.1)),
        (lambda p: FusedLARS(p, lr=0.1), lambda p: FusedLARS(p, lr=0.1)),
        (lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: FusedLAMB(p, lr=1e-2)),
        (lambda p: FusedLAMB(p, lr=1e-2), lambda p: FusedLAMB(p, lr=1e-2)),
    ],
)
def test_state_dicts_load_from_the_plain_optimizer_and_round_trip(make_before, make_after):
    """A fit can switch from SGD to LARS (or AdamW to LAMB) when its batch grows: the
    momentum (the moments and step counts) carry over; and our own state round-trips."""
    model = new_model(torch.float64)
    before = make_before(model.parameters())
    train_fused(model, before, batches(3, torch.float64))
    saved_model, saved = {k: v.clone() for k, v in model.state_dict().items()}, before.state_dict()

    def resumed():
        m = new_model(torch.float64)
        m.load_state_dict(saved_model)
        opt = make_after(m.parameters())
        opt.load_state_dict(saved)
        return train_fused(m, opt, batches(4, torch.float64, seed=2)), opt

    (a, opt_a), (b, _) = resumed(), resumed()
    assert max_abs_diff(a, b) == 0.0
    key = "momentum_buffer" if isinstance(opt_a, FusedLARS) else "exp_avg"
    first = next(iter(model.parameters()))
    state = opt_a.state_dict()["state"][0]
    assert key in state and state[key].shape == first.shape
    # the state went on from the loaded one (not from zeros): differs from a fresh start
    fresh = new_model(torch.float64)
    fresh.load_state_dict(saved_model)
    train_fused(fresh, make_after(fresh.parameters()), batches(4, torch.float64, seed=2))
    assert max_abs_diff(a, fresh) > 1e-6


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: FusedLARS(p, lr=0.1, trust_coefficient=0), "trust_coefficient=0"),
        (lambda p: FusedLARS(p, lr=0.1, trust_coefficient=-1.0), "trust_coefficient=-1.0"),
        (lambda p: FusedLARS(p, lr=0.1, eps=float("nan")), "eps=nan"),
        (lambda p: FusedLARS(p, lr=0.1, exclude_1d="yes"), "exclude_1d='yes'"),
        (lambda p: FusedLARS(p, lr=-0.1), "lr=-0.1"),
        (lambda p: FusedLARS(p, lr=0.1, momentum=0.0, nesterov=True), "nesterov=True"),
        (lambda p: FusedLAMB(p, betas=(0.9, 1.0)), "betas[1]=1.0"),
        (lambda p: FusedLAMB(p, exclude_1d=1), "exclude_1d=1"),
        (
            lambda p: FusedLAMB([{"params": p, "maximize": True}]),
            "FusedLAMB: maximize=True in param_groups[0] is not supported",
        ),
    ],
)
def test_bad_options_are_named(make, message):
    with pytest.raises(ConfigError) as info:
        make(new_model().parameters())
    assert message in str(info.value)


def test_a_bad_loaded_state_is_named():
    opt = FusedLARS(new_model().parameters(), lr=0.1)
    state = opt.state_dict()
    state["param_groups"][0]["trust_coefficient"] = 0.0
    with pytest.raises(ConfigError, match="the state_dict's param_groups\\[0\\]"):
        FusedLARS(new_model().parameters(), lr=0.1).load_state_dict(state)


def test_a_plain_adamw_state_loads_but_an_amsgrad_one_is_refused():
    model = new_model()
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ConfigError, match="amsgrad"):
        FusedLAMB(new_model().parameters()).load_state_dict(amsgrad.state_dict())
    assert isinstance(FusedLAMB(model.parameters()), FusedAdam)


# -- in a fit --------------------------------------------------------------------------


def lars(params):
    return FusedLARS(params, lr=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.01)


def lamb(params):
    return FusedLAMB(params, lr=0.01, weight_decay=0.01)


@pytest.mark.slow  # a fit on the cluster
@pytest.mark.parametrize("make", [lars, lamb], ids=["lars", "lamb"])
def test_a_growing_batch_fit_on_two_replicas_equals_the_one_process_loop(client, make):
    """The use LARS and LAMB exist for: the batch (and LR) growing between phases, the
    replicas' shares of it uneven; the reduced gradient is the global batch's, so the
    trust ratios are the one-process loop's."""
    x, y = make_data(96)
    schedule = dfl.schedule.Stepwise({0: 8, 1: 32}, lr_scaling="linear", warmup_steps=2)
    # and in micro-batches: the 32-sample phase's shares of 16 run as 4 of 4
    pipe = tiny_pipeline(x, y, optimizer=make, schedule=schedule, max_micro_batch=4)
    result = pipe.fit(epochs=3, client=client)
    assert result.history.phases[1]["micro_batches"] == [4, 4]
    assert [p["global_batch"] for p in result.history.phases] == [8, 32]
    batches_ = pipe.sample_plan(epochs=3, replicas=2)
    base = make(TinyCNN().parameters()).param_groups[0]["lr"]
    lrs = [base] * 12 + [lr_at(base, base * 4, k, 2) for k in range(6)]
    expected = reference_training(x, y, batches=batches_, seed=0, optimizer=make, lrs=lrs)
    assert max_abs_diff(result.model, expected) <= 1e-5


@pytest.mark.slow  # two fits on the cluster
def test_async_staleness_zero_applies_lars_on_whole_tensors(client):
    """The parameter store shards whole tensors, so its LARS ratios are the tensors':
    ``Async(staleness=0)`` with FusedLARS is the synchronous FusedLARS fit (3:1 split)."""
    x, y = make_data(96)
    options = dict(optimizer=lars, balancer=dfl.balance.Proportional((3, 1)))
    async_ = tiny_pipeline(x, y, sync=dfl.sync.Async(staleness=0), **options)
    synchronous = tiny_pipeline(x, y, **options)
    a = async_.fit(epochs=2, client=client)
    b = synchronous.fit(epochs=2, client=client)
    assert a.history.info["sync"].startswith("asynchronous")
    assert max_abs_diff(a.model, b.model) <= 1e-6


@pytest.mark.slow  # four fits on the cluster
@pytest.mark.parametrize("sync", [None, dfl.sync.Local(period_steps=2)], ids=["sync", "local"])
def test_a_fit_resumed_inside_a_phase_with_lamb_is_bit_identical(client, tmp_path, sync):
    """LAMB's state (moments and per-tensor step counts in flat buffers) survives a
    checkpoint and, under local updates, the replicas' averages: the resumed fit ends
    with the uninterrupted one's bits."""
    from test_mid_phase_checkpoints import _assert_same_weights, _keep_up_to

    from dataflow.checkpoint import CheckpointStore

    x, y = make_data(160)
    options = dict(
        optimizer=lamb,
        schedule=dfl.schedule.Stepwise({0: 16, 2: 32}, lr_scaling="sqrt", warmup_steps=4),
        window_steps=2,  # pinned: checkpoint points in every phase, however fast the machine
        **({"sync": sync} if sync is not None else {}),
    )
    folder = dict(checkpoint_dir=tmp_path, keep_checkpoints=1000)
    full = tiny_pipeline(x, y, **options).fit(3, client=client, checkpoint_every=1, **folder)
    mid = [c for c in full.history.info["checkpoints"] if c["mid_phase"]]
    store = CheckpointStore(tmp_path, keep=1000)
    _keep_up_to(store, store.path(mid[1]["step"]))
    resumed = tiny_pipeline(x, y, **options).fit(3, client=client, resume=True, **folder)
    assert resumed.history.info["resumed_from"]["step"] == mid[1]["step"]
    _assert_same_weights(full.model, resumed.model)
    assert [s["loss"] for s in resumed.history.steps] == [s["loss"] for s in full.history.steps]


@pytest.mark.slow  # two fits on the cluster
def test_a_sgd_fit_resumed_with_lars_carries_its_momentum_over(client, tmp_path):
    """Switching to LARS when the batch has grown, as a user does it: resume the SGD
    fit's checkpoint with a FusedLARS factory. The momentum buffers load (torch's
    names) and the options are the new factory's (its weight decay, not SGD's 0), so
    the fit equals the one-process loop that switches at the same step."""
    x, y = make_data(96)
    sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    first = tiny_pipeline(x, y, optimizer=sgd).fit(2, client=client, checkpoint_dir=tmp_path)
    then = tiny_pipeline(x, y, optimizer=lars)
    result = then.fit(3, client=client, checkpoint_dir=tmp_path, resume=True)
    assert result.history.info["resumed_from"]["epoch"] == 2

    batches_ = then.sample_plan(epochs=3, replicas=2)
    torch.manual_seed(0)
    model = TinyCNN()
    opt = sgd(model.parameters())
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for step, parts in enumerate(batches_):
        if step == len(first.history.steps):  # the switch, with the state carried over
            switched = lars(model.parameters())
            # the factory's options (lr, weight decay), the checkpoint's momentum
            options = switched.state_dict()["param_groups"]
            switched.load_state_dict(opt.state_dict() | {"param_groups": options})
            opt = switched
        index = torch.from_numpy(np.concatenate(parts))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt[index]), yt[index]).backward()
        opt.step()
    assert max_abs_diff(result.model, model) <= 1e-5
