"""Fits across emulated nodes: Dask workers in network namespaces on veth links
(``dataflow.tools.emulated_nodes``), each with its own address, as on a real cluster."""

from __future__ import annotations

import pytest
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline

import dataflow as dfl
from dataflow.tools.emulated_nodes import EmulatedNodes, unavailable

REASON = unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
]


@pytest.fixture(scope="module")
def nodes():
    """Three nodes on 1 Gbit/s links, each with a decoy interface listed before its own:
    collectives and the data plane must bind to the worker's address, not the first
    interface up."""
    with EmulatedNodes(3, rate_mbit=1000, decoy=True) as emulated:
        yield emulated


def test_a_fit_across_three_emulated_nodes_equals_single_process_training(nodes):
    x, y = make_data(144)
    options = dict(batch=48, replicas=3, collective_timeout_s=30.0)
    result = tiny_pipeline(x, y, **options).fit(epochs=2, client=nodes.address)
    workers = result.history.info["workers"]
    assert sorted(w["worker"].split("://")[1].rsplit(":", 1)[0] for w in workers) == sorted(
        nodes.node_addresses
    ), workers  # one replica per node, each at its node's own address
    batches = tiny_pipeline(x, y, batch=48).sample_plan(epochs=2, replicas=3)
    assert max_abs_diff(result.model, reference_training(x, y, batches=batches, seed=0)) <= 1e-5


def test_asynchronous_updates_push_across_the_nodes(nodes):
    """The parameter store's data plane listens on its host node's address: the other
    nodes' replicas reach it through the links (at staleness 0: synchronous training)."""
    x, y = make_data(96)
    sync = dfl.sync.Async(staleness=0)
    options = dict(batch=48, replicas=3, sync=sync, collective_timeout_s=30.0)
    result = tiny_pipeline(x, y, **options).fit(epochs=2, client=nodes.address)
    batches = tiny_pipeline(x, y, batch=48).sample_plan(epochs=2, replicas=3)
    assert max_abs_diff(result.model, reference_training(x, y, batches=batches, seed=0)) <= 1e-5


def test_a_killed_run_leaves_nothing_behind_the_next_one_removes():
    """A run killed before its clean-up (SIGKILL, a CI timeout) leaves namespaces and
    links named after its process; the next run removes those of dead processes."""
    import subprocess

    from dataflow.tools.emulated_nodes import remove_stale

    dead = 2**22 + 12345  # above Linux's default pid_max: no such process
    subprocess.run(["ip", "netns", "add", f"dataflow-{dead}-0"], check=True)
    subprocess.run(["ip", "link", "add", f"dfb{dead % 100000}", "type", "bridge"], check=True)
    assert f"dataflow-{dead}-0" in remove_stale()
    assert (
        f"dataflow-{dead}-0"
        not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"dfb{dead % 100000}" not in links
