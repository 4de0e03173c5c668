"""What ``fit(client=...)`` runs on (a cluster object, a scheduler address, anything else),
and a Ctrl-C during a fit on the embedded LocalCluster."""

import operator
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import distributed
import pytest
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline
from distributed import Client, LocalCluster

import dataflow as dfl
from dataflow.runtime.cluster import client_or_local_cluster

HERE = Path(__file__).parent


@pytest.fixture
def no_default_client(monkeypatch):
    """As in a script that made no Client of its own: Dask's default-client lookups
    (``distributed.wait`` makes one) find none, whatever clients other tests opened."""
    monkeypatch.setattr(distributed.client, "_global_clients", weakref.WeakValueDictionary())
    with pytest.raises(ValueError, match="No clients found"):
        distributed.default_client()


def _clients(client: Client) -> set[str]:
    return set(client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.clients)))


@pytest.mark.slow
def test_fit_on_a_cluster_object_and_on_its_address(no_default_client) -> None:
    x, y = make_data(64)
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=2)
    expected = reference_training(x, y, batches=batches, seed=0)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, set_as_default=False) as watcher,
    ):
        before = _clients(watcher)
        for target in (cluster, cluster.scheduler_address):
            result = tiny_pipeline(x, y).fit(2, client=target)
            assert len(result.history.steps) == 8  # 2 epochs of 64 samples at 16
            assert max_abs_diff(result.model, expected) <= 1e-5
            assert _clients(watcher) == before  # the client fit connected is closed again
        # the caller's cluster stays up, with its workers
        assert len(watcher.scheduler_info()["workers"]) == 2
        assert watcher.submit(operator.add, 41, 1).result() == 42
        assert cluster.status.name == "running"


@pytest.mark.parametrize(
    ("client", "shown"),
    [
        (True, r"client=True \(bool\)"),
        (["tcp://127.0.0.1:8786"], r"client=\['tcp://127\.0\.0\.1:8786'\] \(list\)"),
        (LocalCluster, r"client=LocalCluster is a class; pass an instance, LocalCluster\(\.\.\.\)"),
    ],
    ids=["bool", "list-of-addresses", "cluster-class"],
)
def test_anything_else_as_client_is_named_with_what_fit_accepts(client, shown) -> None:
    x, y = make_data(32)
    with pytest.raises(dfl.ConfigError) as caught:
        tiny_pipeline(x, y).fit(1, client=client)
    message = str(caught.value)
    assert caught.match(f"^{shown}")
    for accepted in ("distributed.Client", "scheduler address", "cluster object", "None"):
        assert accepted in message


def test_an_interrupt_on_a_cluster_of_the_callers_says_so_and_propagates(capsys) -> None:
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
        with (
            pytest.raises(KeyboardInterrupt),
            client_or_local_cluster(cluster, announce=False) as connected,
        ):
            raise KeyboardInterrupt  # in the fit
        assert connected.status == "closed" and cluster.status.name == "running"
        with Client(cluster, set_as_default=False) as caller:
            with pytest.raises(KeyboardInterrupt), client_or_local_cluster(caller):
                raise KeyboardInterrupt
            assert caller.status == "running"
    assert capsys.readouterr().err.splitlines() == [
        "dataflow: interrupted; the fit stopped, disconnecting from the cluster",
        "dataflow: interrupted; the fit stopped, the client stays open",
    ]


@pytest.mark.slow
def test_ctrl_c_stops_a_fit_on_the_embedded_cluster_promptly_and_quietly(tmp_path) -> None:
    started, log = tmp_path / "started", tmp_path / "output.txt"
    with log.open("w") as output:
        driver = subprocess.Popen(
            [sys.executable, str(HERE / "interrupt_driver.py"), str(started)],
            cwd=HERE,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group of its own, as a terminal's job
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # all of it in the log, if it hangs
        )
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert driver.poll() is None, f"the fit ended before it trained:\n{log.read_text()}"
            assert time.monotonic() < deadline, "the fit did not start training in time"
            time.sleep(0.05)
        # Ctrl-C: the terminal sends SIGINT to the whole foreground group, the embedded
        # cluster's worker processes included
        os.killpg(driver.pid, signal.SIGINT)
        try:
            driver.wait(timeout=20)  # a bound, not a speed target: it took 32-34 s before
        except subprocess.TimeoutExpired:  # where each of its threads is, in the log
            os.kill(driver.pid, signal.SIGUSR2)
            time.sleep(2)
            pytest.fail(f"the driver still ran 20 s after Ctrl-C:\n{log.read_text()}")
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    text = log.read_text()
    assert driver.returncode == -signal.SIGINT, text  # the KeyboardInterrupt propagated
    assert text.count("dataflow: interrupted; ") == 1, text
    assert text.count("Traceback") == 1 and text.rstrip().endswith("KeyboardInterrupt"), text
    assert "Dask Worker process" not in text and "Timed out" not in text, text
    _assert_group_ends(driver.pid)  # the cluster's worker processes ended with the driver


def _assert_group_ends(group: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(group, signal.SIGKILL)
            pytest.fail("worker processes of the embedded cluster outlived the driver")
        time.sleep(0.1)


async def _removed(cluster, address: str) -> None:
    """The scheduler's word that ``address`` left, as the cluster's watch takes it (on
    the cluster's event loop)."""
    cluster._update_worker_status("remove", address)


def test_an_embedded_workers_heartbeat_to_a_closed_scheduler_is_not_printed() -> None:
    """The Ctrl-C test's one line was followed, once in CI, by a worker's heartbeat
    traceback: the scheduler (in the driver's process) had closed the connection. Such a
    heartbeat is dropped; one that times out (a stalled driver), and other errors, stay."""
    import logging

    from distributed.comm.core import CommClosedError

    from dataflow.runtime.interrupt import SchedulerClosedHeartbeat

    def record(message: str, error: BaseException | None) -> logging.LogRecord:
        exc_info = None if error is None else (type(error), error, None)
        return logging.LogRecord("distributed.worker", logging.ERROR, "", 0, message, (), exc_info)

    heartbeat = "Failed to communicate with scheduler during heartbeat."
    keep = SchedulerClosedHeartbeat().filter
    assert not keep(record(heartbeat, CommClosedError("in <TCP (closed)>: Stream is closed")))
    assert keep(record(heartbeat, TimeoutError("timed out")))
    assert keep(record("Compute Failed", CommClosedError("closed")))
    assert keep(record(heartbeat, None))


def test_the_embedded_cluster_outlives_a_worker_removed_twice():
    """A SIGKILLed worker can reach the cluster's watch of the scheduler as removed twice
    (dask/distributed issue 5407). The stock LocalCluster's watch dies on the second,
    and closing the cluster, after a fit that recovered from the loss, raised
    ``KeyError: 'tcp://...'``; the embedded cluster forgets the worker once."""
    from dataflow.runtime.cluster import EmbeddedCluster

    with EmbeddedCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster:
        [address] = cluster.scheduler_info["workers"]
        cluster.sync(_removed, cluster, address)
        cluster.sync(_removed, cluster, address)  # the stock cluster's watch: KeyError
        assert address not in cluster.scheduler_info["workers"]
    # (and the close: the scheduler's own word that the worker left comes a third time)
