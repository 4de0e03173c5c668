"""Evaluation sees held-out inputs preprocessed as the training inputs were.

The graph's deterministic Transform stages before Forward (Log1p, Standardize) are
applied to the held-out batches; random augmentations (RandomFlip) are not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, make_data, sgd

import dataflow as dfl
from dataflow import stages
from dataflow.core.window import WHOLE, scored_samples
from dataflow.errors import ConfigError, GraphError
from dataflow.stages.base import ReplicaContext, StepContext, StepSpec
from dataflow.stages.evaluate import whole_from_shares
from dataflow.trainer import Trainer

LOG = dfl.ops.Log1p(scale=2.0)
STD = dfl.ops.Standardize(mean=(0.6,), std=(0.3,))
FLIP = dfl.ops.RandomFlip(axes=(2, 3), p=1.0)  # p=1: would flip every held-out sample


def positive_data(n: int):
    x, y = make_data(n)
    return abs(x), y  # Log1p needs x > -1/scale


def training_graph(x, y, eval_x, eval_y, *, eval_transforms=None):
    """Load -> Log1p -> Standardize -> RandomFlip -> Forward -> ... -> Update -> Evaluate."""
    g = dfl.Graph()
    node = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    for fn in (LOG, STD, FLIP):
        node = g.add(stages.Transform(fn), node)
    node = g.add(stages.Forward(TinyCNN, F.cross_entropy), node)
    node = g.add(stages.Backward(), node)
    node = g.add(stages.AllReduce(), node)
    node = g.add(stages.Update(sgd), node)
    evaluate = stages.Evaluate(
        dfl.io.ArraySource(eval_x, eval_y, shuffle=False),
        metrics={"loss": F.cross_entropy},
        transforms=eval_transforms,
    )
    g.add(evaluate, node)
    return g, evaluate


def by_hand(model, x, y, transforms=(LOG, STD)) -> float:
    """The held-out loss computed in plain torch on transformed inputs."""
    xt = torch.from_numpy(x)
    for fn in transforms:
        xt = fn(xt)
    with torch.no_grad():
        return F.cross_entropy(model(xt), torch.from_numpy(y)).item()


def last_step(evaluate, model) -> StepContext:
    replica = ReplicaContext(rank=0, world_size=1, device=torch.device("cpu"), seed=0, model=model)
    spec = StepSpec(
        index=0,
        epoch=0,
        step_in_epoch=0,
        start=0,
        global_batch=8,
        local_batches=(8,),
        last_in_epoch=True,
    )
    return StepContext(replica=replica, spec=spec)


def test_bind_takes_the_deterministic_transforms_before_forward_in_order():
    x, y = positive_data(32)
    graph, evaluate = training_graph(x, y, x, y)
    evaluate.bind(graph)
    assert [fn for fn, _ in evaluate.transforms] == [LOG, STD]  # RandomFlip left out


def test_evaluation_applies_the_graph_transforms_without_a_cluster():
    x, y = positive_data(48)
    graph, evaluate = training_graph(x[:32], y[:32], x[32:], y[32:])
    evaluate.bind(graph)
    torch.manual_seed(0)
    model = TinyCNN()
    result = evaluate.evaluate_shard(last_step(evaluate, model))
    expected = by_hand(model, x[32:], y[32:])
    assert result["count"] == 16
    assert result["loss"] / 16 == pytest.approx(expected, rel=1e-5)
    # The transforms matter here: the raw or the flipped inputs give another loss.
    assert abs(by_hand(model, x[32:], y[32:], transforms=()) - expected) > 1e-3
    assert abs(by_hand(model, x[32:], y[32:], transforms=(LOG, STD, FLIP)) - expected) > 1e-4


def test_a_held_out_read_stuck_in_a_store_outage_ends_when_the_window_is_aborted():
    """The held-out batches are read on a thread, a batch ahead of the model; when the
    driver aborts the window (a peer's wait for this replica timed out) while a read
    hangs, the evaluation stops with an echo of the abort instead of outliving it, and
    the model is left in training mode. Read in order, the scores are those read inline."""
    import threading

    from dataflow.core.errors import CollectiveError

    x, y = positive_data(48)
    graph, evaluate = training_graph(x[:32], y[:32], x[32:], y[32:])
    evaluate.bind(graph)
    torch.manual_seed(0)
    model = TinyCNN()
    inline = by_hand(model, x[32:], y[32:])
    evaluate.config = dataclasses.replace(evaluate.config, batch_size=4)  # 4 batches
    assert evaluate.evaluate_shard(last_step(evaluate, model))["loss"] / 16 == pytest.approx(
        inline, rel=1e-5
    )

    source, stuck, reading = evaluate.source, threading.Event(), threading.Event()

    class StuckAtTheThirdBatch:
        num_samples = source.num_samples

        def read(self, indices):
            if indices[0] == 8:
                reading.set()
                stuck.wait(timeout=60)
            return source.read(indices)

    evaluate.source = StuckAtTheThirdBatch()
    outcome = []

    def evaluating():
        try:
            evaluate.evaluate_shard(last_step(evaluate, model))
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=evaluating)
    thread.start()
    assert reading.wait(timeout=60)
    evaluate.interrupt("the fit's driver aborted the window")
    thread.join(timeout=60)
    stuck.set()
    assert not thread.is_alive()
    [error] = outcome
    assert isinstance(error, CollectiveError) and "held-out set" in str(error)
    assert model.training
    # an abort that comes as the reading begins ends it too; the next phase reads again
    evaluate.source = source
    with pytest.raises(CollectiveError, match="held-out set"):
        evaluate.evaluate_shard(last_step(evaluate, model))
    evaluate.begin_phase(None, None)
    assert evaluate.evaluate_shard(last_step(evaluate, model))["count"] == 16


def test_the_shares_nobody_handed_in_are_scored_here_and_the_sum_is_whole():
    """Asynchronous or local updates: the replicas' held-out sums meet at the parameter
    store; a share no replica handed in (its replica was lost before) the survivor
    scores itself, so its result holds the whole set's sums, marked ``WHOLE``."""
    x, y = positive_data(60)
    graph, evaluate = training_graph(x[:30], y[:30], x[30:], y[30:])
    evaluate.bind(graph)
    torch.manual_seed(0)
    model = TinyCNN()
    step = last_step(evaluate, model)
    step.replica.world_size = 3
    handed = {r: evaluate.evaluate_shard(step, r) for r in (0, 1)}  # replica 2 lost
    scored = []

    def score_share(rank):
        scored.append(rank)
        return evaluate.evaluate_shard(step, rank)

    scores = whole_from_shares(handed, 3, score_share)
    assert scored == [2]
    assert scores["count"] == 30 and scores[WHOLE] == 1.0
    assert scores["loss"] / 30 == pytest.approx(by_hand(model, x[30:], y[30:]), rel=1e-5)
    assert scored_samples([scores, scores]) == 30  # every survivor's result: one count


def test_explicit_transforms_override_the_graph_and_random_ones_are_refused():
    x, y = positive_data(48)
    graph, evaluate = training_graph(x[:32], y[:32], x[32:], y[32:], eval_transforms=[LOG])
    evaluate.bind(graph)  # explicit transforms are kept
    assert [fn for fn, _ in evaluate.transforms] == [LOG]
    torch.manual_seed(0)
    model = TinyCNN()
    result = evaluate.evaluate_shard(last_step(evaluate, model))
    assert result["loss"] / 16 == pytest.approx(by_hand(model, x[32:], y[32:], (LOG,)), rel=1e-5)
    none = stages.Evaluate(graph["Load"].source, metrics={"loss": F.cross_entropy}, transforms=())
    none.bind(graph)
    assert none.transforms == ()
    with pytest.raises(ConfigError, match=r"RandomFlip.*random augmentation"):
        stages.Evaluate(x, metrics={"loss": F.cross_entropy}, transforms=[LOG, FLIP])


def test_transform_on_targets_is_applied_to_targets():
    x, y = positive_data(16)
    shift = stages.Transform(lambda t: (t + 1) % 3, apply_to="y")
    evaluate = stages.Evaluate(
        dfl.io.ArraySource(x, y, shuffle=False),
        metrics={"loss": F.cross_entropy},
        transforms=[shift],
    )
    torch.manual_seed(0)
    model = TinyCNN()
    result = evaluate.evaluate_shard(last_step(evaluate, model))
    with torch.no_grad():
        expected = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy((y + 1) % 3))
    assert result["loss"] / 16 == pytest.approx(expected.item(), rel=1e-5)


def test_several_forwards_are_ambiguous():
    x, y = positive_data(16)
    g = dfl.Graph()
    load = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    for _ in range(2):
        node = g.add(stages.Forward(TinyCNN, F.cross_entropy), g.add(stages.Transform(LOG), load))
        g.add(stages.Backward(), node)
    evaluate = stages.Evaluate(dfl.io.ArraySource(x, y), metrics={"loss": F.cross_entropy})
    g.add(evaluate, load)
    with pytest.raises(GraphError, match="several Forward stages"):
        evaluate.bind(g)


def test_fit_evaluates_on_transformed_held_out_data(client):
    """Through the engine: the bound transforms travel to the workers with the graph."""
    x, y = positive_data(96)
    graph, evaluate = training_graph(x[:64], y[:64], x[64:], y[64:])
    evaluate.bind(graph)
    trainer = Trainer(graph, schedule=dfl.schedule.Fixed(16), device="cpu", progress=False)
    result = trainer.fit(2, client)
    expected = by_hand(result.model, x[64:], y[64:])
    assert result.history.epochs[-1]["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_pipeline_evaluates_with_its_transforms(client):
    """``Pipeline(transforms=..., eval_source=...)``: evaluation uses Log1p/Standardize."""
    x, y = positive_data(96)
    result = dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=F.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ArraySource(x[:64], y[:64]),
        transforms=[LOG, STD, FLIP],
        eval_source=dfl.io.ArraySource(x[64:], y[64:], shuffle=False),
        schedule=dfl.schedule.Fixed(16),
        progress=False,
    ).fit(epochs=1, client=client)
    expected = by_hand(result.model, x[64:], y[64:])
    assert result.history.epochs[-1]["eval_loss"] == pytest.approx(expected, rel=1e-5)
