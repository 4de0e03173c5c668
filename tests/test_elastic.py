"""Workers joining between phases, and asking the cluster for them as the batch grows."""

import pytest
import torch
from conftest import TinyCNN, make_data, max_abs_diff, reference_training, tiny_pipeline
from distributed import Client, LocalCluster
from test_weight_average import assert_close_states, averaged_reference

import dataflow as dfl
from dataflow.driver import group_forming
from dataflow.errors import ConfigError

pytestmark = pytest.mark.slow


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def test_scale_with_batch_grows_the_cluster_and_keeps_training_exact():
    x, y = make_data(96)
    schedule = dfl.schedule.Stepwise({0: 16, 1: 64}, lr_scaling="linear")
    pipe = tiny_pipeline(
        x,
        y,
        optimizer=plain_sgd,
        schedule=schedule,
        max_micro_batch=32,
        scale_with_batch=True,
        max_workers=2,
        ema_decay=0.9,
    )
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        result = pipe.fit(epochs=3, client=client)
        assert len(client.scheduler_info()["workers"]) == 2
    phases = result.history.phases
    assert [p["replicas"] for p in phases] == [1, 2]
    assert [p["local_batches"] for p in phases] == [[16], [32, 32]]
    assert result.history.info["regroups"][0]["phase"] == 1
    assert result.history.info["scaling"][0]["requested"] == 2
    for epoch in range(3):  # every sample once per epoch, before and after the join
        assert result.ledger.consumed(epoch).tolist() == list(range(96))
    assert result.ledger.replicas(2) == [0, 1]
    # The joined replica got the weights, the momentum and the weights' moving average
    # (all in the optimizer state it is sent): the fit equals one process.
    batches = pipe.sample_plan(epochs=3, replicas=[1, 2])
    lrs = [0.02] * 6 + [0.08] * 4
    expected, average = averaged_reference(x, y, batches, optimizer=plain_sgd, decay=0.9, lrs=lrs)
    assert max_abs_diff(result.model, expected) <= 1e-5
    assert_close_states(result.ema_model.state_dict(), average, 1e-5)


def test_scale_with_batch_needs_a_cap_and_a_maximum():
    x, y = make_data(16)
    with pytest.raises(ConfigError, match="max_micro_batch"):
        tiny_pipeline(x, y, scale_with_batch=True, max_workers=4)
    with pytest.raises(ConfigError, match="max_workers"):
        tiny_pipeline(x, y, scale_with_batch=True, max_micro_batch=8)
    with pytest.raises(ConfigError, match="replicas=None"):
        tiny_pipeline(x, y, scale_with_batch=True, max_micro_batch=8, max_workers=2, replicas=1)


class OnlyOn:
    """A model factory that builds TinyCNN only on the given workers (and on the driver,
    for its dry run), as on a node that lacks a library the model needs elsewhere."""

    def __init__(self, workers: tuple[str, ...]) -> None:
        self.workers = workers

    def __call__(self) -> torch.nn.Module:
        from distributed import get_worker

        try:
            here = get_worker().address
        except ValueError:  # not on a worker: the driver's dry run
            return TinyCNN()
        if here not in self.workers:
            raise ModuleNotFoundError("No module named 'libfoo' (this node lacks it)")
        return TinyCNN()


def test_a_worker_that_cannot_set_up_is_left_out_and_the_fit_goes_on():
    """scale_with_batch asks the cluster for a second worker for phase 1; that node
    cannot build the model (its own error, not a peer's loss). The fit does not stop:
    the node is excluded, recorded with its error, and the first replica trains phase 1
    alone (in micro-batches), exactly as a one-replica fit of the same batches."""
    x, y = make_data(96)
    schedule = dfl.schedule.Stepwise({0: 16, 1: 64}, lr_scaling="linear")
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        first = tuple(client.scheduler_info()["workers"])
        pipe = tiny_pipeline(
            x,
            y,
            model=OnlyOn(first),
            optimizer=plain_sgd,
            schedule=schedule,
            max_micro_batch=32,
            scale_with_batch=True,
            max_workers=2,
        )
        result = pipe.fit(epochs=3, client=client)
        joined = [w for w in client.scheduler_info()["workers"] if w not in first]
    [failure] = result.history.info["failures"]
    assert failure["reason"] == "a worker failed to set up", failure
    assert failure["lost"] == joined and "No module named 'libfoo'" in failure["error"]
    assert failure["replicas_after"] == 1 and failure["window_steps_lost"] == 0
    assert [p["replicas"] for p in result.history.phases] == [1, 1]
    for epoch in range(3):
        assert result.ledger.consumed(epoch).tolist() == list(range(96))
    batches = pipe.sample_plan(epochs=3, replicas=[1, 1])
    lrs = [0.02] * 6 + [0.08] * 4
    expected = reference_training(x, y, batches=batches, seed=0, optimizer=plain_sgd, lrs=lrs)
    assert max_abs_diff(result.model, expected) <= 1e-5


@pytest.mark.timeout(150)
def test_a_first_group_worker_that_cannot_set_up_is_left_out_unless_every_one_fails(
    monkeypatch,
):
    """Of a first group of two workers, one cannot build the model (its node's fault):
    it is left out and the other trains alone, exactly as a one-replica fit. When no
    worker can, the error is the fit's own: it stops with it. The driver's grace for
    the others' errors is set to 10 minutes here: the healthy worker, waiting for the
    failed one in the group's first collective, is released by giving the forming up
    (it used to hold the grace, or the collective timeout, to its end); and a worker
    that fails after the grace
    would raise the same error as the first, which stops the fit too."""
    monkeypatch.setattr(group_forming, "FAILURE_GRACE_S", 600.0)
    x, y = make_data(96)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        good, bad = sorted(client.scheduler_info()["workers"])
        # (a collective timeout of 10 minutes too: it used to end that wait after 30 s)
        pipe = tiny_pipeline(
            x, y, model=OnlyOn((good,)), optimizer=plain_sgd, collective_timeout_s=600.0
        )
        result = pipe.fit(epochs=2, client=client)
        with pytest.raises(ModuleNotFoundError, match="No module named 'libfoo'"):
            tiny_pipeline(x, y, model=OnlyOn(()), optimizer=plain_sgd).fit(epochs=1, client=client)
    [failure] = result.history.info["failures"]
    assert failure["reason"] == "a worker failed to set up" and failure["lost"] == [bad]
    assert failure["replicas_before"] == 2 and failure["replicas_after"] == 1
    assert [p["replicas"] for p in result.history.phases] == [1]
    batches = pipe.sample_plan(epochs=2, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0, optimizer=plain_sgd)
    assert max_abs_diff(result.model, expected) <= 1e-5
