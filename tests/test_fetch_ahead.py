"""Fetching ahead (``io.fetch.FetchAhead``) within a byte budget, two plans sharing one.

The store is zarr's own ``MemoryStore`` whose reads wait until the test lets each object
through, so what a plan has asked for at each moment is a fact the test sets up, not a
race: the budget decides which objects may be asked for, and the test waits (bounded)
for each request it expects.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from dataflow.io.fetch import FetchAhead

SIZE = 40  # bytes each object counts against the budget


class GatedStore(MemoryStore):
    """A MemoryStore whose ``get`` of a key waits until :meth:`release` lets it through;
    ``asked``: the keys asked for so far, in order."""

    def __init__(self, keys: list[str]) -> None:
        buffer = default_buffer_prototype().buffer
        super().__init__({key: buffer.from_bytes(key.encode() * 8) for key in keys})
        self.asked: list[str] = []
        self.released: set[str] = set()

    async def get(self, key, prototype, byte_range=None):
        self.asked.append(key)
        while key not in self.released:
            await asyncio.sleep(0.002)
        return await super().get(key, prototype, byte_range)

    def release(self, key: str) -> None:
        self.released.add(key)


def eventually(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.fixture
def store():
    return GatedStore(["a0", "a1", "a2", "b0", "b1"])


def plan(store, keys, **options):
    return FetchAhead([(store, key, SIZE) for key in keys], max_bytes=100, **options)


def taken(plan_, store, key: str) -> bytes:
    future = plan_.take(store, key)
    store.release(key)
    return future.result(timeout=30).to_bytes()


def test_a_plan_asks_for_what_its_budget_holds_and_the_next_as_the_decode_takes_them(store):
    first = plan(store, ["a0", "a1", "a2"])
    try:
        eventually(lambda: store.asked == ["a0", "a1"], f"asked {store.asked}")
        time.sleep(0.1)
        assert store.asked == ["a0", "a1"] and not first.launched_all  # 3 x 40 > 100
        assert taken(first, store, "a0") == b"a0" * 8
        # (launched_all is set as a2's fetch is handed to the loop; its get runs after)
        eventually(lambda: store.asked == ["a0", "a1", "a2"], "a2 never asked for")
        assert first.launched_all and first.peak_bytes <= 100
    finally:
        first.close()


def test_the_next_plan_fetches_within_what_the_one_before_leaves_of_the_budget(store):
    first = plan(store, ["a0", "a1", "a2"])
    second = None
    try:
        eventually(lambda: store.asked == ["a0", "a1"], f"asked {store.asked}")
        second = plan(store, ["b0", "b1"], after=first)
        time.sleep(0.1)
        assert "b0" not in store.asked  # the first holds 80 of 100: no room for 40 more
        taken(first, store, "a0")  # a2 takes its place: still 80 held
        eventually(lambda: first.launched_all, "a2 never asked for")
        time.sleep(0.1)
        assert "b0" not in store.asked
        taken(first, store, "a1")  # 40 held by the first: room for one of the second's
        eventually(lambda: "b0" in store.asked, "b0 never asked for")
        time.sleep(0.1)
        assert "b1" not in store.asked  # 40 + 40 held, 40 more would pass 100
        first.close()  # the epoch before is done: its bytes no longer count
        eventually(lambda: "b1" in store.asked, "b1 never asked for")
        assert taken(second, store, "b0") == b"b0" * 8
        assert taken(second, store, "b1") == b"b1" * 8
        assert second.peak_bytes <= 100
    finally:
        first.close()
        if second is not None:
            second.close()
