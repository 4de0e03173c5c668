"""The user's ``fit(on_epoch=...)`` callbacks, called by the loop as each epoch's record
is complete (its last window committed), once per epoch.

Their verdict is an event for the machine: :class:`~dataflow.driver.events.
EpochReviewed` for every epoch the commit completed (with the reason, when one raised
``StopTraining``: the machine ends the fit at that epoch's end), or, when one raised
anything else, a ``CommitRefused`` carrying a :class:`~dataflow.errors.CallbackError`
(the fit stops with it). The callbacks never decide anything themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dataflow.callbacks import EpochCallback, StopTraining
from dataflow.core.errors import CallbackError
from dataflow.driver import events as ev


class EpochCallbacks:
    """Calls ``callbacks`` with each new epoch record, in order. ``reported``: the last
    epoch they were called for (a resumed fit's earlier epochs, or those a restart
    trains again, are not reported twice; their review is sent again, as the machine
    may wait for it)."""

    def __init__(self, callbacks: Sequence[EpochCallback], reported: int = -1) -> None:
        self.callbacks = tuple(callbacks)
        self.reported = reported
        self.stop: dict[str, Any] | None = None  # the first stop asked for

    def after_commit(self, history: Any, new: Sequence[Any]) -> list[Any]:
        """The events the epoch records ``new`` (those a commit added to ``history``)
        call for; none without callbacks."""
        if not self.callbacks:
            return []
        out: list[Any] = []
        for record in new:
            epoch = int(record["epoch"])
            stop = None
            if epoch > self.reported:
                self.reported = epoch
                for callback in self.callbacks:
                    try:
                        callback(record, history)
                    except StopTraining as asked:
                        stop = stop or self._stop(epoch, asked, callback, history)
                    except Exception as error:
                        failed = CallbackError(
                            f"the on_epoch callback {_name(callback)} raised "
                            f"{type(error).__name__}: {error} (after epoch {epoch}); the fit "
                            "stopped. Fix the callback, or catch what it may raise in it"
                        )
                        failed.__cause__ = error
                        return [*out, ev.CommitRefused(failed)]
            elif self.stop is not None and self.stop["after_epoch"] == epoch:
                stop = self.stop["reason"]  # trained again after a restart: same verdict
            out.append(ev.EpochReviewed(epoch, stop))
        return out

    def _stop(self, epoch: int, asked: StopTraining, callback: Any, history: Any) -> str:
        reason = str(asked) or f"{_name(callback)} raised StopTraining"
        if self.stop is None:
            self.stop = {"after_epoch": epoch, "reason": reason}
            history.info["stopped_early"] = self.stop
        return reason


def _name(callback: Any) -> str:
    name = getattr(callback, "__name__", None) or type(callback).__name__
    return f"{name}()" if name != "<lambda>" else "(a lambda)"
