"""The user's ``fit(on_epoch=...)`` callbacks, called by the loop as each epoch's record
is complete (its last window committed), once per epoch.

What a callback asks for becomes an event for the machine: ``StopTraining`` a
:class:`~dataflow.driver.events.StopAsked` (the machine ends the fit at its next phase
boundary), any other exception a ``CommitRefused`` carrying a
:class:`~dataflow.errors.CallbackError` (the fit stops with it). The callbacks never
decide anything themselves.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from dataflow.callbacks import EpochCallback, StopTraining
from dataflow.core.errors import CallbackError
from dataflow.driver import events as ev


class EpochCallbacks:
    """Calls ``callbacks`` with each new epoch record, in order. ``reported``: the last
    epoch they were called for (a resumed fit's earlier epochs, or those a restart
    trains again, are not reported twice)."""

    def __init__(self, callbacks: Sequence[EpochCallback], reported: int = -1) -> None:
        self.callbacks = tuple(callbacks)
        self.reported = reported
        self.stop: dict[str, Any] | None = None  # the first stop asked for

    def after_commit(self, history: Any, phase_end_epoch: int | None) -> list[Any]:
        """The events the epochs ``history`` gained call for; ``phase_end_epoch``: where
        the running phase ends (a stop takes effect there)."""
        out: list[Any] = []
        for record in history.epochs:
            epoch = int(record["epoch"])
            if epoch <= self.reported or not self.callbacks:
                continue
            self.reported = epoch
            for callback in self.callbacks:
                try:
                    callback(record, history)
                except StopTraining as stop:
                    out.extend(self._stop(epoch, stop, callback, phase_end_epoch, history))
                except Exception as error:
                    failed = CallbackError(
                        f"the on_epoch callback {_name(callback)} raised "
                        f"{type(error).__name__}: {error} (after epoch {epoch}); the fit "
                        "stopped. Fix the callback, or catch what it may raise in it"
                    )
                    failed.__cause__ = error
                    return [*out, ev.CommitRefused(failed)]
        return out

    def _stop(
        self, epoch: int, stop: StopTraining, callback: Any, end: int | None, history: Any
    ) -> list[Any]:
        if self.stop is not None:
            return []
        reason = str(stop) or f"{_name(callback)} raised StopTraining"
        self.stop = {"after_epoch": epoch, "reason": reason}
        history.info["stopped_early"] = self.stop
        if end is not None and end > epoch + 1:
            warnings.warn(
                f"StopTraining after epoch {epoch} ({reason}): the fit stops at the end of "
                f"its phase, after epoch {end - 1}; to stop at an epoch's end, give the "
                "schedule phases of one epoch (Fixed(B, epochs_per_phase=1), Adaptive)",
                stacklevel=2,
            )
        return [ev.StopAsked(epoch, reason)]


def _name(callback: Any) -> str:
    name = getattr(callback, "__name__", None) or type(callback).__name__
    return f"{name}()" if name != "<lambda>" else "(a lambda)"
