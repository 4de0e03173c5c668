"""``sync_batchnorm=True``: BatchNorm statistics of the global batch, reduced over the
replicas, so W replicas on any split equal one process (which a model with BatchNorm
does not otherwise: each replica would normalise by its own local batch)."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_data, sgd, tiny_pipeline

import dataflow as dfl
from dataflow.core.step import micro_batch_sizes
from dataflow.core.window import PEER_WAIT, compute_seconds
from dataflow.errors import ConfigError
from dataflow.stages.group_batchnorm import ReplicaBatchNorm, ReplicaGroup, replica_batchnorm


class BatchNormCNN(torch.nn.Module):
    """TinyCNN with a BatchNorm after each convolution (1 x 8 x 8 inputs, 3 classes)."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4, momentum=momentum)
        self.conv2 = torch.nn.Conv2d(4, 4, 3)
        self.bn2 = torch.nn.BatchNorm2d(4, momentum=momentum)
        self.head = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1))


def one_process(x, y, batches, optimizer=sgd, autocast_dtype=None) -> torch.nn.Module:
    """The single-process loop over the same global batches: BatchNorm over each (under
    CPU autocast to ``autocast_dtype``, when given)."""
    torch.manual_seed(0)
    model = BatchNormCNN().train()
    opt = optimizer(model.parameters())
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for parts in batches:
        index = torch.from_numpy(np.concatenate(parts))
        with torch.autocast(
            "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=bool(autocast_dtype)
        ):
            loss = torch.nn.functional.cross_entropy(model(xt[index]), yt[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


class ThreadGroup:
    """Ranks as threads of this process: ``allreduce_`` sums over them (a barrier each),
    to check the arithmetic without processes; the fits below use the real collectives."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier = size, threading.Barrier(size)
        self.slots: list = [None] * size

    def member(self, rank: int, share: float, global_batch: int) -> ReplicaGroup:
        group = self

        class Member(ReplicaGroup):
            def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
                group.slots[rank] = tensor.clone()
                group.barrier.wait()
                total = sum(group.slots)
                group.barrier.wait()
                tensor.copy_(total)
                return tensor

        return Member(rank=rank, size=self.size, share=share, global_batch=global_batch)


def test_a_model_made_of_replica_layers_keeps_its_state_dict_and_alone_is_torchs():
    """The replaced layers hold the model's own parameters and buffers under the same
    names; on one replica (and in evaluation) they are torch's BatchNorm bit for bit,
    running statistics and the cumulative average (momentum=None) included."""
    for momentum in (0.1, None):
        torch.manual_seed(0)
        plain = BatchNormCNN(momentum)
        synced = BatchNormCNN(momentum)
        synced.load_state_dict(plain.state_dict())
        assert replica_batchnorm(synced, ReplicaGroup()) == 2
        assert isinstance(synced.bn, ReplicaBatchNorm)
        assert list(synced.state_dict()) == list(plain.state_dict())
        x = torch.randn(6, 1, 8, 8)
        for _ in range(3):
            assert torch.equal(synced(x), plain(x))
        assert distance(synced, plain) == 0.0
        assert int(synced.bn.num_batches_tracked) == 3
        synced.eval(), plain.eval()
        assert torch.equal(synced(x), plain(x))


@pytest.mark.parametrize("split", [(2, 4), (1, 5), (0, 6)])
def test_replicas_normalise_by_the_global_batch_and_their_gradients_add_up(split):
    """Two ranks holding 2:4, 1:5 or 0:6 of a batch of 6, each the gradient of its own
    local mean loss: weighted by their shares, the gradients (and the running
    statistics) are those of one process on the whole batch."""
    torch.manual_seed(0)
    reference = BatchNormCNN()
    initial = copy.deepcopy(reference.state_dict())
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 3, (6,))
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    group = ThreadGroup(2)
    models, errors = [], []

    def rank(r: int, lo: int, hi: int) -> None:
        try:
            model = BatchNormCNN()
            model.load_state_dict(initial)
            replica_batchnorm(model, group.member(r, (hi - lo) / 6, 6))
            out = model(x[lo:hi])
            if hi > lo:
                torch.nn.functional.cross_entropy(out, y[lo:hi]).backward()
            else:  # no samples: it takes part, with a zero
                (out.sum() * 0.0).backward()
            models.append((r, model, (hi - lo) / 6))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            group.barrier.abort()

    cut = split[0]
    threads = [threading.Thread(target=rank, args=a) for a in ((0, 0, cut), (1, cut, 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, param in reference.named_parameters():
        combined = sum(
            dict(m.named_parameters())[name].grad * share
            for _, m, share in models
            if dict(m.named_parameters())[name].grad is not None
        )
        assert torch.allclose(combined, param.grad, atol=1e-6), name
    for _, model, _ in models:  # every rank's running statistics: the whole batch's
        for name in ("bn.running_mean", "bn.running_var", "bn2.running_var"):
            got, want = model.state_dict()[name], reference.state_dict()[name]
            assert torch.allclose(got, want, atol=1e-6), name


def test_each_reduction_holds_2c_values_whatever_the_group_size_and_stays_accurate():
    """Three ranks, a batch of 9 with a large offset (mean 1e4, std 1): every collective
    a layer makes is 2C values (the moments' sums in float64, the adjoint's), not a row
    per rank, and the statistics are the whole batch's to float32's precision."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4)
    x = torch.randn(9, 4, 5, 5) + 1e4
    group, sizes, errors, outputs = ThreadGroup(3), [], [], {}

    def rank(r: int) -> None:
        try:
            member = group.member(r, 1 / 3, 9)
            reduce = member.allreduce_

            def recording(tensor):
                sizes.append((r, tensor.numel(), tensor.dtype))
                return reduce(tensor)

            member.allreduce_ = recording
            layer = ReplicaBatchNorm(copy.deepcopy(bn), member)
            part = x[3 * r : 3 * r + 3].clone().requires_grad_()
            layer(part).pow(2).sum().backward()
            outputs[r] = (layer.running_mean.clone(), layer.running_var.clone())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {(n, dtype) for _, n, dtype in sizes} == {
        (8, torch.float32),  # the adjoint's two sums
        (8, torch.float64),  # the moments' two sums
    }
    reference = copy.deepcopy(bn).double().train()
    reference(x.double())
    for mean, var in outputs.values():
        assert torch.allclose(mean.double(), reference.running_mean, rtol=1e-6)
        assert torch.allclose(var.double(), reference.running_var, rtol=1e-4)


@pytest.mark.slow  # (two runtimes on real gloo groups: about 3 s)
def test_a_replica_waiting_on_a_slow_peer_in_batchnorm_counts_the_wait_apart():
    """Two replicas on real gloo groups, one window of a step: replica 1 is slow (its
    first layer holds it ``HOLD`` s after replica 0 reached its first BatchNorm
    reduction). Replica 0 waits there at least that long, and the wait is recorded
    apart from its Forward (``stage_seconds["peer_wait"]``), so the balancer's compute
    (``compute_seconds``) leaves it out: inside Forward, it made the fast replica look as
    slow as the one it waited for, and ``Throughput()`` split them nearly evenly."""
    import cloudpickle
    import torch.distributed as dist
    from conftest import gloo_pair

    from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec
    from dataflow.stages.base import PhaseContext

    hold = 0.4
    x, y = make_data(16)
    pipe = tiny_pipeline(x, y, model=BatchNormCNN, batch=16, sync_batchnorm=True)
    trainer = pipe.trainer
    trainer._dry_run()
    [plan] = trainer.plan(1, 2)
    collectives = gloo_pair(dist.HashStore(), "peer-wait")
    entered, results, errors = threading.Event(), {}, []

    def replica(rank: int) -> None:
        try:
            graph = cloudpickle.loads(cloudpickle.dumps(trainer.graph))  # a worker's copy
            spec = ReplicaSpec(
                run_id="wait", graph=graph, order=graph.validate(replicas=2), seed=0, device="cpu"
            )
            runtime = ReplicaRuntime(spec, rank=rank, world_size=2, collective=collectives[rank])
            model = runtime.context.model
            if rank == 0:  # it reached its first reduction
                model.bn.register_forward_pre_hook(lambda *_: entered.set())
            else:  # a slow node: its first layer takes ``hold`` seconds more than its peer's

                def slow(*_):
                    entered.wait(timeout=60)
                    time.sleep(hold)

                model.conv.register_forward_pre_hook(slow)
            runtime.begin_phase(PhaseContext(index=0, steps=plan.steps[:1], lr=None))
            results[rank] = runtime.run_window(0, 1)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            entered.set()

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    fast, slow = results[0].stage_seconds, results[1].stage_seconds
    assert fast[PEER_WAIT] >= hold / 2  # held at least ``hold`` less the moments' arithmetic
    waiting = {"Load", "AllReduce"}
    assert compute_seconds(fast, waiting) == pytest.approx(
        sum(v for name, v in fast.items() if name not in (*waiting, PEER_WAIT))
    )
    assert slow["Forward"] >= hold  # its slowness is its own compute


@pytest.mark.parametrize(
    "options, clash",
    [
        (dict(sync=dfl.sync.Local(period_steps=2)), "sync=Local"),
        (dict(sync=dfl.sync.Async(staleness=1)), "sync=Async"),
        (dict(compile=True), "compile=True"),
        # the noise scale needs each replica's gradient of its own samples alone
        (dict(schedule=dfl.schedule.Adaptive(8, max_batch=32)), "a schedule that measures"),
        (dict(schedule=dfl.schedule.Stepwise({0: 8, 1: 16})), "a schedule that measures"),
    ],
)
def test_where_replicas_do_not_run_each_forward_together_it_is_refused(options, clash):
    x, y = make_data(32)
    with pytest.raises(ConfigError, match=f"sync_batchnorm=True with {clash}"):
        tiny_pipeline(x, y, model=BatchNormCNN, sync_batchnorm=True, **options)
    with pytest.raises(ConfigError, match="sync_batchnorm='yes'"):
        tiny_pipeline(x, y, model=BatchNormCNN, sync_batchnorm="yes")
    fixed_rule = dfl.schedule.Stepwise({0: 8, 1: 16}, lr_scaling="linear")  # measures nothing
    tiny_pipeline(x, y, model=BatchNormCNN, sync_batchnorm=True, schedule=fixed_rule)


@pytest.mark.slow
def test_two_replicas_on_any_split_equal_one_process_with_batchnorm(client):
    """36 samples at B=32 split 3:29: steps of (3, 29), then a short step of (0, 4) in
    which replica 0 has no sample and takes part anyway. With sync_batchnorm the fit
    is the one-process loop's, weights and running statistics; without, it is not (and
    it ends: before, replica 0 counted one batch fewer in BatchNorm's
    num_batches_tracked, and the phase's end called the replicas' weights diverged)."""
    x, y = make_data(36)
    options = dict(
        model=BatchNormCNN,
        batch=32,
        balancer=dfl.balance.Proportional((3, 29)),
        window_seconds=1e-4,  # one step a window: many windows, still exact
    )
    pipe = tiny_pipeline(x, y, sync_batchnorm=True, **options)
    steps = pipe.plan(epochs=1, replicas=2)[0].steps
    assert [s.local_batches for s in steps] == [(3, 29), (0, 4)]
    result = pipe.fit(epochs=4, client=client)
    assert result.history.info["replicas"] == 2
    [phase] = result.history.phases  # the waits in the reductions: apart from compute
    for rank, seconds in enumerate(phase["stage_seconds"]):
        assert seconds[PEER_WAIT] > 0.0
        rate = phase["samples_trained"][rank] / compute_seconds(seconds, {"Load", "AllReduce"})
        assert phase["samples_per_second"][rank] == pytest.approx(rate)
    batches = pipe.sample_plan(epochs=4, replicas=2)
    expected = one_process(x, y, batches)
    assert distance(result.model, expected) <= 1e-5
    apart = tiny_pipeline(x, y, **options).fit(epochs=4, client=client)
    assert distance(apart.model, expected) > 1e-3  # each replica's own statistics


def one_process_in_micro_batches(x, y, batches, steps) -> torch.nn.Module:
    """The single-process loop accumulating gradients over the global micro-batches of
    each step: the k-th one the k-th micro-batches of every replica, BatchNorm over it,
    its loss weighted by its share of the step's samples."""
    torch.manual_seed(0)
    model = BatchNormCNN().train()
    opt = sgd(model.parameters())
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for parts, spec in zip(batches, steps, strict=True):
        count = spec.micro_batches[0]
        cuts = [
            np.split(p, np.cumsum(micro_batch_sizes(len(p), count, paired=True))) for p in parts
        ]
        opt.zero_grad()
        for k in range(count):
            index = torch.from_numpy(np.concatenate([c[k] for c in cuts]))
            loss = torch.nn.functional.cross_entropy(model(xt[index]), yt[index])
            (loss * len(index) / spec.global_batch).backward()
        opt.step()
    return model


def test_the_planner_gives_every_replica_the_most_split_ones_micro_batches():
    """Under sync_batchnorm the k-th micro-batches of the replicas reduce together, so
    each replica runs a step in as many (empty ones included) as the most split one."""
    x, y = make_data(76)
    options = dict(model=BatchNormCNN, batch=32, max_micro_batch=4)
    split = dict(balancer=dfl.balance.Proportional((1, 7)), **options)
    paired = tiny_pipeline(x, y, sync_batchnorm=True, **split).plan(epochs=1, replicas=2)
    apart = tiny_pipeline(x, y, **split).plan(epochs=1, replicas=2)
    assert [s.micro_batches for s in apart[0].steps] == [(1, 7), (1, 7), (1, 3)]
    assert [s.micro_batches for s in paired[0].steps] == [(7, 7), (7, 7), (3, 3)]
    assert "micro-batches per replica: (7, 7), (3, 3)\n" in str(paired[0])
    last = paired[0].steps[-1]
    assert last.local_batches == (2, 10)
    assert last.paired_micro_batches == (5, 4, 3)  # (1, 1, 0) + (4, 3, 3)
    for spec in paired[0].steps:  # as each replica cuts its batch
        count = spec.micro_batches[0]
        sizes = [micro_batch_sizes(b, count, paired=True) for b in spec.local_batches]
        assert spec.paired_micro_batches == tuple(map(sum, zip(*sizes, strict=True)))
    planner = tiny_pipeline(x, y, sync_batchnorm=True, **split).trainer.planner(epochs=1)
    learned = planner.rest(paired[0].steps, 0, 2, memory_cap=2)  # out of memory on a GPU
    assert [s.micro_batches for s in learned] == [(14, 14), (14, 14), (5, 5)]
    alone = tiny_pipeline(x, y, sync_batchnorm=True, **options).plan(epochs=1, replicas=1)
    assert [s.micro_batches for s in alone[0].steps] == [(8,), (8,), (3,)]


@pytest.mark.slow
def test_with_micro_batches_the_replicas_reduce_each_micro_batch_together(client):
    """76 samples at B=32 split 1:7 under max_micro_batch=4: every replica runs each step
    in 7 micro-batches (3 in the short last step), replica 0's mostly empty; each global
    micro-batch's BatchNorm statistics are reduced over both. The fit equals one
    process accumulating over the same global micro-batches."""
    x, y = make_data(76)
    pipe = tiny_pipeline(
        x,
        y,
        model=BatchNormCNN,
        batch=32,
        max_micro_batch=4,
        balancer=dfl.balance.Proportional((1, 7)),
        sync_batchnorm=True,
    )
    result = pipe.fit(epochs=2, client=client)
    assert [p["micro_batches"] for p in result.history.phases] == [[7, 7]]
    steps = [s for plan in pipe.plan(epochs=2, replicas=2) for s in plan.steps]
    expected = one_process_in_micro_batches(x, y, pipe.sample_plan(epochs=2, replicas=2), steps)
    assert distance(result.model, expected) <= 1e-5


@pytest.mark.slow
def test_in_bf16_the_replicas_reduce_in_fp32_as_one_process(client):
    """precision="bf16" (CPU autocast): the layers' statistics reduced in fp32 from the
    bf16 activations, the fit the torch autocast loop's to bf16's tolerance (0.009 here;
    each replica over its own batch: 0.10)."""
    x, y = make_data(36)
    pipe = tiny_pipeline(
        x,
        y,
        model=BatchNormCNN,
        batch=32,
        balancer=dfl.balance.Proportional((3, 29)),
        sync_batchnorm=True,
        precision="bf16",
    )
    result = pipe.fit(epochs=4, client=client)
    assert result.history.info["workers"][0]["precision"] == "bf16"
    batches = pipe.sample_plan(epochs=4, replicas=2)
    assert distance(result.model, one_process(x, y, batches, autocast_dtype=torch.bfloat16)) < 0.03


@pytest.mark.slow
def test_with_phases_evaluation_and_an_average_it_is_still_one_process(client):
    """Two phases (the global batch, and so each step's count, changes), a 1:2 split,
    a held-out evaluation each epoch (running statistics: each replica its own shard,
    no reduction) and a moving average: the weights are the one-process loop's, and
    the last epoch's eval_loss is the returned model's score on the held-out set."""
    x, y = make_data(120)
    held_out = dfl.io.ArraySource(*make_data(40, seed=1))
    pipe = tiny_pipeline(
        x,
        y,
        model=BatchNormCNN,
        schedule=dfl.schedule.Stepwise({0: 12, 1: 24}, lr_scaling="none"),
        balancer=dfl.balance.Proportional((1, 2)),
        eval_source=held_out,
        ema_decay=0.9,
        sync_batchnorm=True,
    )
    result = pipe.fit(epochs=2, client=client)
    assert [p["local_batches"] for p in result.history.phases] == [[4, 8], [8, 16]]
    expected = one_process(x, y, pipe.sample_plan(epochs=2, replicas=2))
    assert distance(result.model, expected) <= 1e-5
    score = pipe.evaluate(held_out, result.model)["loss"]
    assert result.history.epochs[-1]["eval_loss"] == pytest.approx(score, abs=1e-6)
    assert all(np.isfinite(e["eval_ema_loss"]) for e in result.history.epochs)


@pytest.mark.slow
def test_a_fit_resumed_inside_a_phase_equals_the_uninterrupted_one(client, tmp_path):
    """BatchNorm (reduced over the replicas) and dropout, two phases, a 1:2 split:
    resumed from a checkpoint inside a phase, bit for bit the uninterrupted fit."""
    from test_mid_phase_checkpoints import _assert_same_weights, _keep_up_to, _pipeline

    from dataflow.checkpoint.store import CheckpointStore

    x, y = make_data(160)
    options = dict(sync_batchnorm=True, balancer=dfl.balance.Proportional((1, 2)))
    folder = dict(checkpoint_dir=tmp_path, keep_checkpoints=1000)
    full = _pipeline(x, y, **options).fit(3, client=client, checkpoint_every=1, **folder)
    mid = [c for c in full.history.info["checkpoints"] if c["mid_phase"]]
    last = CheckpointStore(tmp_path).path(mid[1]["step"])
    _keep_up_to(CheckpointStore(tmp_path, keep=1000), last)
    resumed = _pipeline(x, y, **options).fit(3, client=client, resume=True, **folder)
    assert resumed.history.info["resumed_from"]["step"] == mid[1]["step"]
    _assert_same_weights(full.model, resumed.model)


class NoEmptyBatches(BatchNormCNN):
    """A model that cannot run a batch of 0 samples (a reduction over the batch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.0 * x.amax()


@pytest.mark.slow
def test_a_model_that_cannot_run_an_empty_batch_is_named_when_a_replica_has_none(client):
    x, y = make_data(36)
    pipe = tiny_pipeline(
        x,
        y,
        model=NoEmptyBatches,
        batch=32,
        balancer=dfl.balance.Proportional((3, 29)),  # step 1: (0, 4)
        sync_batchnorm=True,
    )
    with pytest.raises(dfl.ModelError, match="replica 0 has no samples in step 1"):
        pipe.fit(epochs=1, client=client)
