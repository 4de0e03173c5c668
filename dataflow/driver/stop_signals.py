"""The driver's side of a stop signal: the handlers, and the error the fit ends with.

While a fit runs on the driver's main thread, each of ``TrainerConfig.stop_signals``
(default SIGTERM and SIGUSR1) only records that it came; the loop hands the first one
to the machine as a ``StopRequested`` event at its next poll (within about a second),
and the machine saves what is committed (``dataflow.driver.stopping``). A second signal
of the same kind gets the handler that was there before (for SIGTERM, the default:
the process ends), so a stop that hangs can still be ended. Off the main thread (a fit
started from a thread) Python cannot set handlers, and none is set.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from dataflow.core.errors import FitStopped


class StopSignals:
    """The fit's stop-signal handlers for a ``with`` block; ``received``: the first
    signal's name (None: none came)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = tuple(names)
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.names:
            number = getattr(signal, name, None)
            if number is not None:  # (a platform without it: nothing to catch)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        """Record the first signal (no lock, no I/O: a handler may run between any two
        bytecodes of the loop); the same signal again gets the handler before ours."""
        if self.received is None:
            self.received = signal.Signals(number).name
            return
        before = self._previous.pop(number, signal.SIG_DFL)
        signal.signal(number, before)
        os.kill(os.getpid(), number)


def stopped_error(signal_name: str, commit_step: int, saved_path: Any, store: Any) -> FitStopped:
    """What the fit raises once it stopped on ``signal_name``: where the work is kept
    (``saved_path``: the checkpoint of the commit it just wrote; else the newest in
    ``store``, the fit's CheckpointStore, None without ``checkpoint_dir``)."""
    if saved_path is not None:
        where = (
            f"a checkpoint of step {commit_step} (the last window every replica finished) "
            f"was written to {saved_path}"
        )
        checkpoint = str(saved_path)
    elif store is not None and (newest := store.latest()) is not None:
        where, checkpoint = f"the newest checkpoint is {newest}", str(newest)
    elif store is not None:
        where, checkpoint = f"no checkpoint was written yet in {store.directory}", None
    else:
        return FitStopped(
            f"the fit stopped on {signal_name} at step {commit_step}; no checkpoint_dir "
            "was given, so the work done is lost: pass checkpoint_dir=... (and resume=True "
            "when you run it again) to keep what a stop ends",
            signal=signal_name,
            step=commit_step,
        )
    return FitStopped(
        f"the fit stopped on {signal_name}: {where}; run the same fit with "
        "checkpoint_dir=... and resume=True to go on from it",
        signal=signal_name,
        step=commit_step,
        checkpoint=checkpoint,
    )
