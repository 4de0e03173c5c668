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


def test_an_interrupt_ends_a_wait_for_a_load_that_never_comes():
    """The driver aborted the window while the replica waited for a read stuck in a
    store outage: the waiting ``get`` raises the interrupt's error, so does any later
    one, and closing does not wait for the stuck loader."""
    import threading

    stuck, waiting = threading.Event(), threading.Event()

    def load(i):
        if i == 1:
            waiting.set()
            stuck.wait()
        return i

    fetch = Prefetcher(load, range(5))
    assert fetch.get() == 0
    outcome = []

    def consume():
        try:
            fetch.get()
        except BaseException as error:
            outcome.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert waiting.wait(timeout=60)
    fetch.interrupt(RuntimeError("the window was aborted"))
    consumer.join(timeout=60)
    assert not consumer.is_alive()
    assert [str(e) for e in outcome] == ["the window was aborted"]
    with pytest.raises(RuntimeError, match="aborted"):
        fetch.get()
    fetch.close()  # returns at once, the loader still stuck in item 1
    assert fetch._thread.is_alive()
    stuck.set()
    fetch._thread.join(timeout=60)
    assert not fetch._thread.is_alive()  # it stopped after its item


LEFT_RUNNING_AT_EXIT = """
import sys, threading, time
import torch
from dataflow.io import Prefetcher

busy = threading.Event()

def load(i):  # an item that is all torch calls (each releases the GIL), for 1.5 s
    busy.set()
    a, until = torch.randn(256, 256), time.monotonic() + 1.5
    while time.monotonic() < until:
        a = torch.mm(a, a).clamp_(-1, 1)
    return i

fetch = Prefetcher(load, range(5))
busy.wait()
fetch.interrupt(RuntimeError("the window was aborted"))
fetch.close()  # does not wait: the loader is inside its item
assert fetch._thread.is_alive()
sys.exit(0)  # the interpreter ends while the loader is inside torch
"""


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_a_loader_left_running_ends_before_the_interpreter_does():
    """A loader closed while busy (an aborted window) is joined at exit: a daemon thread
    inside a torch call as the interpreter finalizes aborts the process ("terminate
    called without an active exception", SIGABRT), as a dask-mpi worker did at exit."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", LEFT_RUNNING_AT_EXIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr


def test_an_interrupt_ends_the_reading_even_with_items_loaded_ahead():
    """An abort that came as an evaluation began (or any time): its ``get`` raises the
    interrupt's error, though the next items were loaded already (read from memory, a
    held-out set is loaded ahead in microseconds), and so does every later one."""
    fetch = Prefetcher(lambda i: i, range(5), depth=3)
    deadline = time.monotonic() + 60  # a bound on a real condition, not a pause
    while not fetch._queue.full():
        assert time.monotonic() < deadline, "the prefetcher never filled its queue"
        time.sleep(0.001)
    fetch.interrupt(RuntimeError("the window was aborted"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="aborted"):
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
