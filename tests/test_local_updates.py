"""Local updates (``dfl.sync.Local``, issue 17): each replica steps on its own gradients
for a period (one window), then the replicas average weights and optimizer state,
weighted by the samples each trained on.

The fits run on a real LocalCluster and are compared with the same algorithm written
out by hand in one process: local SGD with momentum over exactly the batches the fit's
plan gives each replica."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import TinyCNN, make_data, max_abs_diff, sgd, tiny_pipeline

import dataflow as dfl
from dataflow.core.errors import ConfigError


def local_sgd_by_hand(x, y, plan, period: int, weights: list[float]) -> torch.nn.Module:
    """Each replica: ``period`` SGD-with-momentum steps on its own parts of the plan
    from the common weights, then weights and momentum become their ``weights``-
    weighted average."""
    torch.manual_seed(0)
    common = TinyCNN()
    opt = sgd(common.parameters())
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    replicas = len(plan[0])
    for start in range(0, len(plan), period):
        models, momenta = [], []
        for r in range(replicas):
            model = copy.deepcopy(common)
            local = sgd(model.parameters())
            local.load_state_dict(copy.deepcopy(opt.state_dict()))  # the common momentum
            for parts in plan[start : start + period]:
                index = torch.from_numpy(parts[r])
                if len(index) == 0:
                    continue
                loss = torch.nn.functional.cross_entropy(model(xt[index]), yt[index])
                local.zero_grad()
                loss.backward()
                local.step()
            models.append(model)
            momenta.append([local.state[p]["momentum_buffer"] for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(common.parameters()):
                replicas_p = [list(m.parameters())[i] for m in models]
                p.copy_(sum(w * q for w, q in zip(weights, replicas_p, strict=True)))
                opt.state[p]["momentum_buffer"] = sum(
                    w * mom[i] for w, mom in zip(weights, momenta, strict=True)
                )
    return common


# -- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: dfl.sync.Local(), "give period_seconds"),
        (lambda: dfl.sync.Local(period_seconds=1.0, period_steps=4), "one of them"),
        (lambda: dfl.sync.Local(period_steps=0), "period_steps=0"),
        (lambda: dfl.sync.Local(period_seconds=-1), "period_seconds=-1"),
    ],
)
def test_a_bad_period_is_named(make, says):
    with pytest.raises(ConfigError, match=says):
        make()


def test_the_period_is_the_window_and_conflicts_are_refused():
    x, y = make_data(32)
    pipe = tiny_pipeline(x, y, sync=dfl.sync.Local(period_steps=4))
    assert pipe.trainer.config.window_steps == 4
    pipe = tiny_pipeline(x, y, sync=dfl.sync.Local(period_seconds=2.5))
    assert pipe.trainer.config.window_seconds == 2.5
    with pytest.raises(ConfigError, match="drop window_steps"):
        tiny_pipeline(x, y, sync=dfl.sync.Local(period_steps=4), window_steps=2)
    with pytest.raises(ConfigError, match="sync=Local does not run"):
        adaptive = dfl.schedule.Adaptive(8, max_batch=32)
        tiny_pipeline(x, y, sync=dfl.sync.Local(period_steps=4), schedule=adaptive)
    with pytest.raises(ConfigError, match="sync=Local with a spatial layout"):
        tiny_pipeline(x, y, sync=dfl.sync.Local(period_steps=4), layout=dfl.Layout(spatial=2))
    with pytest.raises(ConfigError, match=r"dataflow\.sync\.Synchronous"):
        tiny_pipeline(x, y, sync="local")


# -- on a cluster -----------------------------------------------------------------------


@pytest.mark.slow
def test_one_step_per_period_equals_synchronous_training(client):
    """Averaging after every SGD-with-momentum step, weights and momentum alike, is the
    synchronous step: the weighted average of the replicas' updates is the update with
    the weighted mean gradient."""
    x, y = make_data(96)
    local = tiny_pipeline(x, y, sync=dfl.sync.Local(period_steps=1)).fit(epochs=2, client=client)
    synchronous = tiny_pipeline(x, y, window_steps=1).fit(epochs=2, client=client)
    assert local.history.info["replicas"] == 2
    assert local.history.info["sync"].startswith("local updates")
    assert max_abs_diff(local.model, synchronous.model) <= 1e-5


@pytest.mark.slow
def test_local_steps_then_a_sample_weighted_average(client):
    """Four local steps per period on a 3:1 split of every batch (the balancer's
    split of a replica twice as fast, say): the fit equals local SGD by hand with the
    average weighted 3/4 and 1/4, and every sample is trained once per epoch."""
    x, y = make_data(128)
    split = dfl.balance.Proportional((3, 1))
    options = dict(batch=16, balancer=split, sync=dfl.sync.Local(period_steps=4))
    pipe = tiny_pipeline(x, y, **options)
    result = pipe.fit(epochs=2, client=client)
    plan = pipe.sample_plan(epochs=2, replicas=2)
    assert [len(p) for p in plan[0]] == [12, 4]
    expected = local_sgd_by_hand(x, y, plan, period=4, weights=[0.75, 0.25])
    assert max_abs_diff(result.model, expected) <= 1e-5
    synchronous = tiny_pipeline(x, y, batch=16, balancer=split).fit(epochs=2, client=client)
    assert max_abs_diff(result.model, synchronous.model) > 1e-4  # it is not synchronous
    for epoch in range(2):
        assert sorted(result.ledger.consumed(epoch).tolist()) == list(range(128))
    assert np.isfinite([s["loss"] for s in result.history.steps]).all()
