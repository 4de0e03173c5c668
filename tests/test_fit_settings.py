"""A fit's settings (``driver/fit_settings.py``): window length, bucket size, worker count
from the user, else the cost model, else the defaults (pure)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dataflow as dfl
from dataflow.costmodel import ComputeFit, CostModel, Link, Topology
from dataflow.driver.fit_settings import WorkerScaling, more_workers, plan_fit, workers_wanted
from dataflow.planning.layout import starting_workers
from dataflow.trainer_config import TrainerConfig

MIB = 1 << 20
FAST = Topology(intra=Link(latency_s=5e-6, bandwidth=10e9))
SLOW = Topology(intra=Link(latency_s=5e-3, bandwidth=1e7))


def cost_model(topology=FAST, **changes) -> CostModel:
    base = CostModel(
        compute=ComputeFit(points=((8, 0.01), (32, 0.03), (128, 0.11))),
        gradient_bytes=8 * MIB,
        topology=topology,
        window_overhead_s=0.004,
    )
    return base.replace(**changes)


def test_user_values_win_then_the_model_then_the_defaults():
    model = cost_model()
    planned = plan_fit(
        TrainerConfig(cost_model=model), user_bucket_mb=None, replicas=4, global_batch=128
    )
    assert planned.chosen_by == {"window_seconds": "cost model", "bucket_mb": "cost model"}
    assert planned.window_seconds == pytest.approx(0.004 * 0.99 / 0.01)
    assert planned.bucket_mb * MIB in {
        int(m * MIB) for m in (0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64)
    }
    user = plan_fit(
        TrainerConfig(cost_model=model, window_seconds=2.0),
        user_bucket_mb=4.0,
        replicas=4,
        global_batch=128,
    )
    assert (user.window_seconds, user.bucket_mb) == (2.0, 4.0)
    assert set(user.chosen_by.values()) == {"user"}
    default = plan_fit(TrainerConfig(), user_bucket_mb=None, replicas=4, global_batch=128)
    assert (default.window_seconds, default.bucket_mb) == (1.0, 25.0)
    assert set(default.chosen_by.values()) == {"default"}


def test_window_length_stays_within_its_range():
    for overhead, expected in ((1e-6, 0.1), (1.0, 10.0)):
        config = TrainerConfig(cost_model=cost_model(window_overhead_s=overhead))
        planned = plan_fit(config, user_bucket_mb=None, replicas=1, global_batch=8)
        assert planned.window_seconds == expected


def scaling_config(model=None, **options) -> WorkerScaling:
    config = TrainerConfig(
        scale_with_batch=True, max_micro_batch=32, max_workers=8, cost_model=model, **options
    )
    return WorkerScaling.of(config)


def test_scale_with_batch_without_a_model_fills_the_memory_cap():
    assert workers_wanted(scaling_config(), 128).requested == 4
    assert workers_wanted(scaling_config(), 1024).requested == 8
    # the history's row: the count and who chose it
    assert workers_wanted(scaling_config(), 128).to_dict() == {
        "requested": 4,
        "chosen_by": "max_micro_batch",
    }


def test_scale_with_batch_asks_for_the_workers_the_model_says_pay():
    fast = workers_wanted(scaling_config(cost_model()), 256)
    assert fast.chosen_by == "cost model" and fast.requested == 8
    # a network so slow that a second worker costs more than it computes: stay on one,
    # micro-batching under the memory cap
    slow = workers_wanted(scaling_config(cost_model(SLOW)), 256)
    assert slow.requested == 1
    assert slow.predicted_samples_per_second > slow.predicted_at_max
    assert set(slow.to_dict()) == {
        "requested",
        "chosen_by",
        "predicted_samples_per_second",
        "predicted_at_max",
    }


def test_more_workers_are_asked_for_only_when_the_fit_has_fewer():
    assert more_workers(scaling_config(), 128, have=3).requested == 4
    assert more_workers(scaling_config(), 128, have=4) is None
    assert more_workers(scaling_config(), 128, have=5) is None


def test_a_spatial_fit_asks_for_whole_replicas_within_max_workers():
    """max_workers counts workers: with 2 per replica, 8 workers are 4 replicas. The
    batch wants 4 replicas at 128 (8 workers), and at 1024 still 4 (not 32 workers)."""
    spatial = scaling_config(layout=dfl.Layout(spatial=2))
    assert workers_wanted(spatial, 128).requested == 8
    assert workers_wanted(spatial, 1024).requested == 8
    assert workers_wanted(spatial, 64).requested == 4
    assert more_workers(spatial, 128, have=6).requested == 8
    assert more_workers(spatial, 128, have=8) is None
    model = workers_wanted(scaling_config(cost_model(), layout=dfl.Layout(spatial=2)), 256)
    assert model.chosen_by == "cost model" and model.requested % 2 == 0
    assert model.requested <= 8


def test_a_fit_starts_on_the_workers_its_replicas_and_layout_need():
    workers = ["w0", "w1", "w2", "w3", "w4"]
    assert starting_workers(workers, None) == workers  # every worker (spares: the pool's)
    assert starting_workers(workers, 2, size=2) == workers[:4]
    # replicas=None starts no more than max_workers replicas (the rest: the pool's)
    assert starting_workers(workers, None, most=3) == workers[:3]
    assert starting_workers(workers, None, size=2, most=2) == workers[:2]
    # max_workers counts workers, in whole groups: 3 workers hold one group of 2
    assert starting_workers(workers, None, size=2, most=3) == workers[:2]
    assert starting_workers(workers, None, size=2, most=4) == workers[:4]
    assert starting_workers(workers, None, most=8) == workers
    assert starting_workers(workers, 2, most=4) == workers[:2]  # replicas wins
    with pytest.raises(dfl.ConfigError, match=r"^the client has no workers; start some"):
        starting_workers([], None)
    with pytest.raises(dfl.ConfigError, match=r"^replicas=3 but the client has 2 worker"):
        starting_workers(workers[:2], 3)
    with pytest.raises(dfl.ConfigError, match=r"^replicas=3 of 2 workers each need 6 but"):
        starting_workers(workers, 3, size=2)
    with pytest.raises(dfl.ConfigError, match=r"^Layout\(spatial=8\) splits each sample"):
        starting_workers(workers, None, size=8)


def test_the_cost_model_is_validated_where_it_is_given():
    with pytest.raises(dfl.ConfigError, match="cost_model"):
        TrainerConfig(cost_model={"window": 1})


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def tiny_pipeline(samples: int, model) -> dfl.Pipeline:
    """Tiny on ``samples`` random rows, batch 8, planned by the cost ``model``."""
    x, y = torch.randn(samples, 4).numpy(), torch.randint(0, 2, (samples,)).numpy()
    return dfl.Pipeline(
        model=Tiny,
        device="cpu",
        loss=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(8),
        cost_model=model,
    )


def test_the_plan_uses_the_planned_window_and_bucket():
    pipe = tiny_pipeline(512, cost_model(window_overhead_s=0.002))  # 0.198 s windows of 0.01 s
    (plan,) = pipe.plan(epochs=1, replicas=2, step_seconds=0.01)
    assert plan.windows[0].n_steps == 20
    (reducer,) = [s for s in pipe.graph if isinstance(s, dfl.stages.AllReduce)]
    assert reducer.config.bucket_mb is None and reducer.bucket_mb == 25.0  # not planned yet
    assert pipe.trainer.fit_plan(2, 8).chosen_by["bucket_mb"] == "cost model"


def test_a_bf16_allreduce_plans_with_the_bytes_it_moves():
    """``allreduce_dtype="bf16"`` halves what each allreduce moves: the model predicts
    from the wire's bytes, and the bucket it picks in wire bytes is packed from twice as
    many fp32 gradient bytes."""
    from dataflow.driver.fit_settings import planned_model

    model = cost_model()
    config = TrainerConfig(cost_model=model)
    wide = plan_fit(config, user_bucket_mb=None, replicas=4, global_batch=128)
    narrow = plan_fit(config, user_bucket_mb=None, replicas=4, global_batch=128, wire_scale=0.5)
    assert narrow.wire_scale == 0.5 and narrow.to_dict()["wire_scale"] == 0.5
    assert planned_model(config, narrow).gradient_bytes == model.gradient_bytes // 2
    wire_bucket = planned_model(config, narrow).bucket_bytes
    assert wire_bucket == int(narrow.bucket_mb * 0.5 * MIB)  # fp32 bucket, bf16 on the wire
    exposed = [
        planned_model(config, p).breakdown(replicas=4, global_batch=128).allreduce_exposed_s
        for p in (wide, narrow)
    ]
    assert exposed[1] <= exposed[0]


def test_the_planned_bucket_reaches_the_replicas_not_the_users_stage():
    """The fit hands its planned bucket to each replica's context (ReplicaSpec.bucket_mb);
    the user's AllReduce stage keeps what it was given, for the next fit to plan anew."""
    from dataflow.core.step import ReplicaContext
    from dataflow.driver.fit import plan_from_cost_model

    pipe = tiny_pipeline(64, cost_model(window_overhead_s=0.002))
    (reducer,) = [s for s in pipe.graph if isinstance(s, dfl.stages.AllReduce)]
    before = dict(vars(reducer))
    planned = plan_from_cost_model(pipe.trainer, replicas=2, epochs=1).bucket_mb
    assert vars(reducer) == before and reducer.bucket_mb == 25.0  # the stage is as given
    context = ReplicaContext(rank=0, world_size=2, device=torch.device("cpu"), seed=0)
    context.planned_bucket_mb = planned
    assert reducer.bucket_in_use(context) == planned != 25.0
    mine = dfl.stages.AllReduce(bucket_mb=2.0)
    assert mine.bucket_in_use(context) == 2.0  # the user's own wins
