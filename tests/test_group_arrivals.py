"""Forming a process group: every rank announces itself at the store first, where the
wait for a missing peer can be given up (a peer lost while the group forms), before
gloo's own rendezvous, which cannot. In one process, on an in-memory store."""

from __future__ import annotations

import socket
import threading

import pytest
import torch.distributed as dist

from dataflow.errors import CollectiveError
from dataflow.runtime.collective import await_arrivals, connect_store


def _arrive(store, rank: int, world: int, *, aborted=lambda: False, timeout_s: float = 60.0):
    await_arrivals(
        store, rank=rank, world_size=world, timeout_s=timeout_s, aborted=aborted, prefix="fit/g1"
    )


def test_every_rank_returns_once_all_have_arrived():
    store, world = dist.HashStore(), 3
    errors: list = []

    def rank(r: int) -> None:
        try:
            _arrive(store, r, world)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)


def test_an_abort_ends_the_wait_for_a_peer_that_never_comes():
    """Rank 1 never arrives (its worker was killed): once the driver aborts the group,
    rank 0 stops waiting at its next look, long before the collective timeout."""
    store = dist.HashStore()
    aborted = threading.Event()
    threading.Timer(0.2, aborted.set).start()
    with pytest.raises(CollectiveError, match=r"replica 0: forming process group 'fit/g1' was"):
        _arrive(store, 0, 2, aborted=aborted.is_set, timeout_s=3600.0)


def test_without_an_abort_the_timeout_names_the_missing_ranks():
    store = dist.HashStore()
    _arrive_only = dist.PrefixStore("fit/g1/arrived", store)
    _arrive_only.set("1", "1")  # rank 1 came; rank 2 did not
    with pytest.raises(CollectiveError, match=r"ranks 2 of process group 'fit/g1' did not"):
        _arrive(store, 0, 3, timeout_s=0.2)


def _closed_port() -> int:
    """A port nothing listens on (the OS's choice, released again)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_closed_store_is_refused_at_once_not_retried_until_the_timeout():
    """Rank 0's store is open before its address is handed out, so a refused connection
    means it closed (its forming given up, or its worker died): the rank joining says
    so, naming the group and the address. torch's client retried the refusal for the
    whole timeout (an hour here) and held the worker's task thread meanwhile."""
    port = _closed_port()
    with pytest.raises(CollectiveError, match=rf"'fit/g1': its store at 127.0.0.1:{port} refused"):
        connect_store("127.0.0.1", port, 2, 3600.0, prefix="fit/g1")


def test_a_group_given_up_is_not_joined():
    """The driver gave the group up before this rank reached its store: it does not
    connect at all (the store's port may be anything by now)."""
    with pytest.raises(CollectiveError, match=r"forming process group 'fit/g1' was aborted"):
        connect_store("127.0.0.1", _closed_port(), 2, 3600.0, aborted=lambda: True, prefix="fit/g1")


def test_a_live_store_is_joined():
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = connect_store("127.0.0.1", server.port, 2, 30.0, prefix="fit/g1")
    client.set("rank1", "here")
    assert server.get("rank1") == b"here"
