"""The host-to-GPU staging's order of device calls, checked with a stand-in for CUDA:
copies on the side stream, an event after them, the compute stream waiting on that
event before the batch is used, and its tensors marked as used there."""

from __future__ import annotations

import contextlib
import threading

import torch

from dataflow.core.batch import Batch
from dataflow.io.device_staging import DeviceStager


class Recorder:
    """A stand-in for CudaCopies that logs each call with the thread that made it."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.on_side = False
        self.events = 0

    def _note(self, *what) -> None:
        self.log.append((*what, threading.current_thread().name))

    @contextlib.contextmanager
    def on_side_stream(self):
        self.on_side = True
        try:
            yield
        finally:
            self.on_side = False

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        self._note("copy", self.on_side)
        return host.clone()

    def copied(self):
        self.events += 1
        self._note("event", self.on_side)
        return f"event-{self.events}"

    def wait(self, event) -> None:
        self._note("wait", event)

    def used_on_compute_stream(self, tensor: torch.Tensor) -> None:
        self._note("used", tuple(tensor.shape))


def test_each_batch_is_copied_on_the_side_stream_and_waited_for_before_use():
    copies = Recorder()
    stager = DeviceStager(copies)
    batches = [Batch(x=torch.zeros(4, 3), y=torch.zeros(4), size=4) for _ in range(3)]

    def loader() -> None:  # stages every batch ahead, as the prefetch thread does
        for batch in batches:
            stager.stage(batch)

    thread = threading.Thread(target=loader, name="loader")
    thread.start()
    thread.join()
    staged = list(copies.log)
    assert (
        staged
        == [("copy", True, "loader"), ("copy", True, "loader"), ("event", True, "loader")] * 3
    )
    assert [b.ready for b in batches] == ["event-1", "event-2", "event-3"]

    copies.log.clear()
    for batch in batches:  # the compute thread, one step at a time
        stager.hand_over(batch)
        assert batch.ready is None
    main = threading.current_thread().name
    assert copies.log == [
        entry
        for n in (1, 2, 3)
        for entry in (("wait", f"event-{n}", main), ("used", (4, 3), main), ("used", (4,), main))
    ]
    copies.log.clear()
    stager.hand_over(batches[0])  # a batch is waited for once
    assert copies.log == []


def test_several_inputs_and_no_targets_are_staged_alike():
    copies = Recorder()
    stager = DeviceStager(copies)
    batch = stager.stage(Batch(x=(torch.zeros(2, 1), torch.zeros(2, 5)), y=None, size=2))
    assert isinstance(batch.x, tuple) and batch.y is None
    stager.hand_over(batch)
    used = [entry[1] for entry in copies.log if entry[0] == "used"]
    assert used == [(2, 1), (2, 5)]
