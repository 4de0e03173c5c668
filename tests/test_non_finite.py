"""A NaN in the data: caught before the update, then either stop or drop the step.

A dropped step leaves the replica as it was before it: weights, optimizer state and
every buffer (BatchNorm's running statistics and ``num_batches_tracked``, which the
step's forward passes had already moved). The fast tests run one replica in this
process, as the dry run does; the ``slow`` ones fit on the session's LocalCluster."""

import copy
import csv

import numpy as np
import pytest
import torch
from conftest import in_process, make_data, sgd, tiny_pipeline

import dataflow as dfl
from dataflow.errors import ConfigError, NonFiniteError
from dataflow.history.records import StepRecord
from dataflow.history.report import write_report
from dataflow.history.result import FitResult, History, skipped_text
from dataflow.runtime.replica import ReplicaRuntime


def data_with_a_nan(n=64, bad=37):
    x, y = make_data(n)
    x[bad, 0, 3, 3] = np.nan
    return x, y


class BNNet(torch.nn.Module):
    """TinyCNN with a BatchNorm after each convolution."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1))


def learnable_data(n: int, nan_at=(), seed: int = 0):
    """3 classes, each a fixed pattern under noise (chance: about 1/3), with a NaN in the
    samples ``nan_at``."""
    patterns = np.random.default_rng(123).normal(size=(3, 1, 8, 8))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    x = (rng.normal(size=(n, 1, 8, 8)) + patterns[y]).astype(np.float32)
    x[list(nan_at), 0, 3, 3] = np.nan
    return x, y.astype(np.int64)


def accuracy(model: torch.nn.Module, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1) == torch.from_numpy(y)).float().mean())


class PoisonSteps(dfl.stages.Stage):
    """Test stage: a NaN in the last sample of the batch at each step of ``steps``."""

    def __init__(self, steps) -> None:
        super().__init__("PoisonSteps")
        self.steps = set(steps)

    def run(self, step, batch):
        if step.spec.index in self.steps:
            batch.x = batch.x.clone()
            batch.x[-1, 0, 0, 0] = float("nan")
        return batch


def poisoned_graph(steps, on_non_finite="skip", optimizer=sgd) -> dfl.Trainer:
    x, y = learnable_data(64)
    g = dfl.Graph()
    batch = g.add(dfl.stages.Load(dfl.io.ArraySource(x, y)))
    batch = g.add(PoisonSteps(steps), batch)
    out = g.add(dfl.stages.Forward(BNNet, torch.nn.functional.cross_entropy), batch)
    reduced = g.add(dfl.stages.AllReduce(), g.add(dfl.stages.Backward(), out))
    g.add(dfl.stages.Update(optimizer, on_non_finite=on_non_finite), reduced)
    return dfl.Trainer(g, schedule=dfl.schedule.Fixed(16), progress=False, device="cpu")


def replica_state(runtime: ReplicaRuntime) -> dict:
    """Copies of every parameter, buffer and optimizer tensor of the replica."""
    ctx = runtime.context
    return {
        "model": {k: v.detach().clone() for k, v in ctx.model.state_dict().items()},
        "optimizer": copy.deepcopy(ctx.optimizer.state_dict()),
    }


def assert_bit_identical(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bit_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(u, v, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_skipped_step_leaves_buffers_weights_and_optimizer_state_bit_identical(micro_batches):
    """The NaN is in the step's last sample: with 2 micro-batches the first one's forward
    (clean) has moved the BatchNorm statistics too; all of it is undone."""
    runtime, steps = in_process(poisoned_graph(steps={1}), epochs=1, micro_batches=micro_batches)
    try:
        runtime.run_window(0, 1)  # a step applied: momentum and BatchNorm statistics exist
        before = replica_state(runtime)
        assert int(before["model"]["bn.num_batches_tracked"]) == micro_batches
        result = runtime.run_window(1, 2)
        assert result.skipped == [1]
        assert_bit_identical(replica_state(runtime), before)
        result = runtime.run_window(2, len(steps))  # and it trains on
        assert result.skipped == []
        after = runtime.context.model.state_dict()
        assert int(after["bn.num_batches_tracked"]) == micro_batches * (len(steps) - 1)
        assert all(torch.isfinite(t).all() for t in after.values())
        assert not torch.equal(after["bn.running_mean"], before["model"]["bn.running_mean"])
    finally:
        runtime.close()


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_one_replica_verdict_sees_every_nan_and_inf_and_changes_no_gradient(dtype, device):
    """Update's check without a reduced norm (one replica, Local, Async): torch's
    GradScaler check with a scale of 1 over the gradients and the loss. Finite extremes
    (the largest float, a subnormal, -0) pass and stay bit for bit; a NaN or inf in any
    gradient or the loss fails, also among gradients of other dtypes (on CUDA the check
    reads a list as its first tensor's dtype: one list per dtype); a sparse gradient
    (which that check does not take) is checked tensor by tensor."""
    from dataflow.stages.update import _all_finite

    def params(*grads):
        out = []
        for g in grads:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g
            out.append(p)
        return out

    def loss(value):
        return torch.tensor(value, device=device)

    big = torch.finfo(dtype).max
    finite = [
        torch.tensor([big, -big, 1e-40, -0.0], dtype=dtype),
        torch.randn(3, 4).to(dtype).t(),  # not contiguous
        torch.empty(0, dtype=dtype),
        torch.randn(5, dtype=torch.float16),  # another dtype among them
    ]
    finite = [g.to(device) for g in finite]
    before = [g.clone() for g in finite]
    assert bool(_all_finite(loss(2.5), params(*finite)))
    for g, b in zip(finite, before, strict=True):
        bits = g.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(bits, b.contiguous().view(-1).view(torch.uint8))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (dtype, torch.float16):
            poisoned = torch.tensor([1.0, bad], dtype=where, device=device)
            grads = [g.clone() for g in finite] + [poisoned]
            assert not bool(_all_finite(loss(2.5), params(*grads)))
        assert not bool(_all_finite(loss(bad), params(*finite)))
    assert bool(_all_finite(None, []))
    embedding = torch.nn.Embedding(5, 2, sparse=True).to(device)
    embedding(torch.tensor([1, 3], device=device)).sum().backward()
    assert embedding.weight.grad.is_sparse
    assert bool(_all_finite(loss(1.0), list(embedding.parameters())))
    embedding.weight.grad = embedding.weight.grad * float("nan")
    assert not bool(_all_finite(loss(1.0), list(embedding.parameters())))


def test_the_samples_whose_data_is_not_finite_are_named():
    from dataflow.core.batch import Batch
    from dataflow.stages.held_out_checks import non_finite_inputs

    x = torch.zeros(4, 1, 2, 2)
    read = Batch(x=x, y=torch.zeros(4), size=4, indices=np.array([10, 11, 12, 13]))
    assert non_finite_inputs([read]) is None
    transformed = Batch(x=x.clone(), y=torch.zeros(4), size=4, indices=read.indices)
    transformed.x[2, 0, 1, 1] = float("inf")  # (a transform's log of 0)
    assert "(x after the transforms) in sample(s) 12 of" in non_finite_inputs([read, transformed])
    read.y[1] = float("nan")
    read.x[3, 0, 0, 0] = float("nan")
    assert "(x and y as read) in sample(s) 11, 13 (2 samples)" in non_finite_inputs([read])


def test_raise_still_stops_at_the_step_before_anything_changes():
    runtime, _ = in_process(poisoned_graph(steps={1}, on_non_finite="raise"), epochs=1)
    try:
        runtime.run_window(0, 1)
        with pytest.raises(NonFiniteError, match=r"at step 1 .*no update was applied.*'skip'"):
            runtime.run_window(1, 2)
    finally:
        runtime.close()


def test_skipping_equals_training_without_the_poisoned_batches():
    """A BatchNorm CNN, 3 NaN samples in 192, 3 epochs on one replica: the skipped steps
    are those whose batch holds a NaN, and the result is the plain torch loop that never
    saw those batches: weights and running statistics (not NaN), so the model scores on
    clean data like the clean run, far above chance."""
    bad = (5, 77, 150)
    x, y = learnable_data(192, nan_at=bad)
    pipe = dfl.Pipeline(
        model=BNNet,
        loss=torch.nn.functional.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(16),
        on_non_finite="skip",
        device="cpu",
        progress=False,
    )
    batches = [np.concatenate(parts) for parts in pipe.sample_plan(epochs=3, replicas=1)]
    poisoned = [i for i, b in enumerate(batches) if np.isin(b, bad).any()]
    assert 3 <= len(poisoned) <= 9  # each NaN sample in one step of each epoch
    runtime, steps = in_process(pipe.trainer, epochs=3)
    try:
        result = runtime.run_window(0, len(steps))
        state = runtime.state_dict()
    finally:
        runtime.close()
    assert result.skipped == poisoned

    torch.manual_seed(0)  # the reference: the same steps without the poisoned batches
    reference = BNNet()
    opt = sgd(reference.parameters())
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for i, index in enumerate(batches):
        if i not in poisoned:
            loss = torch.nn.functional.cross_entropy(reference(xt[index]), yt[index])
            opt.zero_grad()
            loss.backward()
            opt.step()
    expected = reference.state_dict()
    for key, value in state.items():
        assert torch.isfinite(value).all(), key
        assert torch.allclose(value.double(), expected[key].double(), atol=1e-5), key
    assert int(state["bn.num_batches_tracked"]) == len(batches) - len(poisoned)
    model = BNNet()
    model.load_state_dict(state)
    clean_x, clean_y = learnable_data(300, seed=1)
    assert accuracy(model, clean_x, clean_y) > 0.8  # chance: about 1/3


def test_the_summary_and_the_report_name_the_skipped_steps(tmp_path):
    steps = [
        StepRecord(step=i, phase=0, epoch=0, loss=0.5, samples=16, seconds=0.01, time=0.01 * i,
                   skipped=True if i in (3, 7) else None)
        for i in range(10)
    ]  # fmt: skip
    history = History(steps=steps)
    assert skipped_text(history).startswith(
        "2 steps skipped for a non-finite loss or gradient (on_non_finite='skip'): steps 3, 7;"
    )
    assert skipped_text(History(steps=steps[:3])) is None
    loaded = History.from_json(history.to_json(tmp_path / "h.json"))
    assert [s.get("skipped") for s in loaded.steps] == [s.skipped for s in steps]
    assert "skipped" not in loaded.steps[0]  # absent, not False, where nothing was skipped
    assert "  2 steps skipped" in FitResult(BNNet(), history).summary().splitlines()[1]
    write_report(history, tmp_path / "report")  # (no phases: the plots are left out)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "2 steps skipped for a non-finite loss or gradient" in report
    rows = list(csv.DictReader((tmp_path / "report" / "steps.csv").read_text().splitlines()))
    assert [r["skipped"] for r in rows[2:5]] == ["", "True", ""]


def momentum_half(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.5)  # overlap warns above 0.5


SYNCS = {
    "synchronous": (None, sgd),
    "local": (dfl.sync.Local(period_steps=3), sgd),
    "async": (dfl.sync.Async(staleness=1), sgd),
    "async-overlap": (dfl.sync.Async(staleness=1, overlap=True), momentum_half),
}


@pytest.mark.slow
@pytest.mark.parametrize("sync", list(SYNCS))
def test_skip_keeps_batchnorm_statistics_and_records_the_skipped_steps(client, sync):
    """The issue's case, scaled down: a BatchNorm CNN on 2 replicas, a few NaN samples,
    ``on_non_finite="skip"``. Every step whose global batch holds a NaN is skipped (under
    local or asynchronous updates: the part of the replica that read it), and the model
    returned scores on clean held-out data far above chance: no NaN reached its running
    statistics. The history flags those steps, the phase counts them, the summary says so."""
    policy, optimizer = SYNCS[sync]
    bad = (5, 77, 150)
    x, y = learnable_data(192, nan_at=bad)
    clean_x, clean_y = learnable_data(300, seed=1)
    pipe = dfl.Pipeline(
        model=BNNet,
        loss=torch.nn.functional.cross_entropy,
        optimizer=optimizer,
        source=dfl.io.ArraySource(x, y),
        eval_source=dfl.io.ArraySource(clean_x, clean_y, shuffle=False),
        metrics={"accuracy": dfl.stages.accuracy},
        schedule=dfl.schedule.Fixed(16),
        on_non_finite="skip",
        replicas=2,
        device="cpu",
        progress=False,
        **({} if policy is None else {"sync": policy}),
    )
    result = pipe.fit(epochs=3, client=client)
    batches = [np.concatenate(parts) for parts in pipe.sample_plan(epochs=3, replicas=2)]
    poisoned = [i for i, b in enumerate(batches) if np.isin(b, bad).any()]
    history = result.history
    assert [s["step"] for s in history.steps if s.get("skipped")] == poisoned
    assert history.phases[0]["skipped_steps"] == len(poisoned)
    assert f"{len(poisoned)} steps skipped for a non-finite loss" in result.summary()
    for key, tensor in result.model.state_dict().items():
        assert torch.isfinite(tensor).all(), key
    assert result.model.bn.num_batches_tracked > 0
    assert history.epochs[-1]["eval_accuracy"] > 0.8  # chance: about 1/3
    assert accuracy(result.model, clean_x, clean_y) > 0.8


@pytest.mark.slow
def test_a_nan_stops_the_fit_before_the_update_and_names_the_step(client):
    x, y = data_with_a_nan()
    pipe = tiny_pipeline(x, y, dry_run=False)
    # ... and names the sample whose data is not finite (read on the replica that held it)
    with pytest.raises(
        NonFiniteError,
        match=r"step \d+ \(epoch 0, phase 0\).*no update.*data holds NaN or inf \(x as read\)"
        r" in sample\(s\) 37 of the source",
    ):
        pipe.fit(epochs=1, client=client)


@pytest.mark.slow
def test_skip_drops_only_the_poisoned_steps_and_trains_on(client):
    x, y = data_with_a_nan()
    pipe = tiny_pipeline(x, y, on_non_finite="skip")
    result = pipe.fit(epochs=2, client=client)
    assert result.history.phases[0]["skipped_steps"] == 2  # one step per epoch holds it
    skipped = [s for s in result.history.steps if not np.isfinite(s["loss"])]
    assert len(skipped) == 2
    for tensor in result.model.state_dict().values():
        assert torch.isfinite(tensor).all()
    assert all(np.isfinite(e["train_loss"]) for e in result.history.epochs)


HELD_OUT_BAD = 33  # in the second half of 40 held-out samples: replica 1's share


def held_out_with_a_nan(where: str = "x") -> dfl.io.ArraySource:
    x, y = make_data(40, seed=1)
    if where == "x":
        x[HELD_OUT_BAD, 0, 2, 5] = np.nan
        return dfl.io.ArraySource(x, y, shuffle=False)
    targets = np.eye(3, dtype=np.float32)[y]  # class probabilities: float targets
    targets[HELD_OUT_BAD, 1] = np.inf
    return dfl.io.ArraySource(x, targets, shuffle=False)


@pytest.mark.parametrize("where", ["x", "y"])
def test_a_nan_in_the_held_out_data_names_its_sample_and_the_source(where):
    """Before, eval_loss was nan and eval_accuracy reported as if nothing were wrong."""
    x, y = make_data(64)
    source = held_out_with_a_nan(where)
    pipe = tiny_pipeline(x, y if where == "x" else np.eye(3, dtype=np.float32)[y],
                         eval_source=source, metrics={"accuracy": dfl.stages.accuracy})  # fmt: skip
    runtime, steps = in_process(pipe.trainer, epochs=1)
    try:
        with pytest.raises(dfl.DataError) as info:
            runtime.run_window(steps[0].index, steps[-1].index + 1)
    finally:
        runtime.close()
    cause = "its x (as the model receives it)" if where == "x" else "its y"
    assert str(info.value).startswith(
        f"held-out sample {HELD_OUT_BAD} of eval_source {source!r}: {cause} holds NaN or inf, "
        f"so the held-out loss and metrics would be NaN; fix or drop sample {HELD_OUT_BAD}"
    ), str(info.value)
    assert (info.value.index, info.value.source) == (HELD_OUT_BAD, repr(source))
    assert info.value.__notes__[0].startswith("in stage 'Evaluate' on replica 0, step ")


def test_a_metric_that_is_not_finite_on_finite_data_is_named():
    x, y = make_data(64)
    held_out = dfl.io.ArraySource(*make_data(40, seed=1), shuffle=False)
    log_zero = {"log_zero": lambda out, t: torch.log(torch.zeros(()))}
    pipe = tiny_pipeline(x, y, eval_source=held_out, metrics=log_zero)
    runtime, steps = in_process(pipe.trainer, epochs=1)
    try:
        with pytest.raises(dfl.DataError, match=r"^metric 'log_zero' is -inf on held-out "
                           r"samples 0 to 39 of eval_source ArraySource\(x=\(40, "):  # fmt: skip
            runtime.run_window(steps[0].index, steps[-1].index + 1)
    finally:
        runtime.close()


@pytest.mark.slow
def test_a_nan_in_the_held_out_data_stops_the_fit_at_once_whatever_the_policy(client):
    """From replica 1's share of the held-out set, as a DataError: not a non-finite step
    to roll back and retry with half the LR."""
    x, y = make_data(64)
    pipe = tiny_pipeline(x, y, replicas=2, eval_source=held_out_with_a_nan(),
                         on_non_finite="rollback")  # fmt: skip
    with pytest.raises(dfl.DataError, match=rf"^held-out sample {HELD_OUT_BAD} of eval_source "):
        pipe.fit(epochs=1, client=client)


def test_an_unknown_policy_is_refused():
    x, y = make_data(16)
    with pytest.raises(ConfigError, match="on_non_finite"):
        tiny_pipeline(x, y, on_non_finite="ignore")
    assert issubclass(dfl.NonFiniteError, FloatingPointError)


class PoisonOnce(dfl.stages.Stage):
    """Test stage: a NaN in replica 0's batch at step ``step``, once per ``marker``."""

    def __init__(self, marker: str, step: int) -> None:
        super().__init__("PoisonOnce")
        self.marker, self.step = marker, step

    def run(self, step, batch):
        if step.spec.index == self.step and step.replica.rank == 0:
            from pathlib import Path

            if not Path(self.marker).exists():
                Path(self.marker).touch()
                batch.x = batch.x.clone()
                batch.x[0, 0, 0, 0] = float("nan")
        return batch


@pytest.mark.slow
@pytest.mark.parametrize("check", ["step", "window"])
def test_rollback_goes_back_to_the_last_window_and_halves_the_lr(client, tmp_path, check):
    """``check="window"`` (a GPU's default): the verdict is read once per window, the
    bad window's updates are applied and then discarded by the rollback: same result."""
    from conftest import TinyCNN, sgd

    x, y = make_data(192)
    g = dfl.Graph()
    batch = g.add(dfl.stages.Load(dfl.io.ArraySource(x, y)))
    batch = g.add(PoisonOnce(str(tmp_path / "poisoned"), step=9), batch)
    out = g.add(dfl.stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    grads = g.add(dfl.stages.Backward(), out)
    reduced = g.add(dfl.stages.AllReduce(), grads)
    g.add(dfl.stages.Update(sgd, on_non_finite="rollback", check=check), reduced)
    trainer = dfl.Trainer(
        g, schedule=dfl.schedule.Fixed(16), progress=False, window_seconds=0.2, dry_run=False
    )
    result = trainer.fit(epochs=2, client=client)

    [event] = result.history.info["failures"]
    assert event["reason"] == "non-finite" and event["lr_factor"] == 0.5
    assert event["commit_step"] <= 9 and event["lost"] == []
    assert result.history.info["process_groups"] == 1  # rolled back in place, no new group
    assert "step 9" in event["error"]
    assert result.history.phases[0]["lr"] == pytest.approx(0.05 * 0.5)  # sgd's lr, halved
    steps = [s["step"] for s in result.history.steps]
    assert steps == list(range(len(steps)))  # each step once, the bad one replayed
    assert all(np.isfinite(s["loss"]) for s in result.history.steps)
    for epoch in (0, 1):
        assert result.ledger.summary()[epoch]["consumed"] == 192
    for tensor in result.model.state_dict().values():
        assert torch.isfinite(tensor).all()


@pytest.mark.slow
def test_a_window_check_stops_the_fit_naming_the_step_and_refuses_skip(client):
    from conftest import TinyCNN, sgd

    x, y = data_with_a_nan()
    g = dfl.Graph()
    batch = g.add(dfl.stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(dfl.stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    reduced = g.add(dfl.stages.AllReduce(), g.add(dfl.stages.Backward(), out))
    g.add(dfl.stages.Update(sgd, check="window"), reduced)
    trainer = dfl.Trainer(g, schedule=dfl.schedule.Fixed(16), progress=False, dry_run=False)
    with pytest.raises(NonFiniteError, match=r"step \d+ \(phase 0\).*end of its window"):
        trainer.fit(epochs=1, client=client)
    with pytest.raises(ConfigError, match="check='window', on_non_finite='skip'"):
        dfl.stages.Update(sgd, check="window", on_non_finite="skip")
