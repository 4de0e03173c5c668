import time

import numpy as np
import pytest
import torch

import dataflow as dfl
from dataflow.io import ArraySource, Prefetcher


def test_read_returns_the_asked_samples_in_order():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = torch.arange(10)
    batch = ArraySource(x, y).read(np.array([7, 2, 5]))
    assert batch.size == 3
    assert batch.x[:, 0].tolist() == [14.0, 4.0, 10.0]
    assert batch.y.tolist() == [7, 2, 5]


def test_x_and_y_with_different_sample_counts():
    with pytest.raises(dfl.DataError, match="x has 10 samples but y has 9"):
        ArraySource(np.zeros((10, 2)), np.zeros(9))


def test_non_numeric_and_non_array_inputs():
    with pytest.raises(dfl.DataError, match=r"x has dtype <U1.*astype\('float32'\)"):
        ArraySource(np.array(["a", "b"]))
    with pytest.raises(dfl.DataError, match="y must be a numpy array or a torch tensor"):
        ArraySource(np.zeros((2, 1)), [0, 1])
    with pytest.raises(dfl.DataError, match="no samples"):
        ArraySource(np.zeros((0, 3)))


def test_prefetcher_keeps_order_and_stops():
    fetch = Prefetcher(lambda i: i * i, range(5), depth=2)
    assert [fetch.get() for _ in range(5)] == [0, 1, 4, 9, 16]
    with pytest.raises(StopIteration):
        fetch.get()
    fetch.close()


def test_prefetcher_raises_the_loader_error_at_its_item():
    def load(i):
        if i == 2:
            raise OSError("chunk 2 unreadable")
        return i

    fetch = Prefetcher(load, range(5))
    assert [fetch.get(), fetch.get()] == [0, 1]
    with pytest.raises(OSError, match="chunk 2"):
        fetch.get()
    fetch.close()


def test_prefetcher_reads_ahead_at_most_depth():
    """Nothing taken: the thread loads ``depth`` items into the queue and one more, then
    waits in put (the queue full) until the consumer takes one."""
    loaded = []

    def load(i):
        loaded.append(i)
        return i

    fetch = Prefetcher(load, range(100), depth=3)
    deadline = time.monotonic() + 60  # a generous bound on a real condition, not a pause
    while not (len(loaded) >= 3 + 1 and fetch._queue.full()):
        assert time.monotonic() < deadline, f"the prefetcher never filled its queue: {loaded}"
        time.sleep(0.001)
    assert loaded == [0, 1, 2, 3]  # depth queued plus the one waiting in put
    assert fetch.get() == 0  # a slot is free: it reads one more
    fetch.close()
