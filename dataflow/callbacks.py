"""What a fit calls after each epoch: ``fit(on_epoch=...)``.

A callback is any callable ``fn(epoch, history)``, called on the driver once the
epoch's record is complete (its training loss, and its held-out metrics when the graph
evaluates): ``epoch`` is the record (``epoch["eval_loss"]``), ``history`` the fit's
history so far. It runs between two commits of the driver's loop, so the replicas
keep training meanwhile: log to W&B or MLflow there, print, write a file; keep it
quick, and do not change ``history``.

A callback that raises :class:`StopTraining` ends the fit at the end of that epoch: with
callbacks, the driver plans no step past an epoch's end before they ran. A callback
that raises anything else stops the fit with :class:`~dataflow.errors.CallbackError`:
a mistake in it is never skipped silently.

The other rule a fit applies after each epoch is :class:`KeepBest`
(``fit(keep_best=...)``): which epoch's weights to keep. It shares
:class:`EarlyStopping`'s idea of "better" (:func:`improves`), so the two watching one
metric agree on the best epoch.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from dataflow.core.errors import ConfigError

__all__ = [
    "EarlyStopping",
    "EpochCallback",
    "KeepBest",
    "StopTraining",
    "as_keep_best",
    "check_callbacks",
]

EpochCallback = Callable[[Mapping[str, Any], Any], Any]


class StopTraining(Exception):
    """Raised by an ``on_epoch`` callback: end the fit at the end of this epoch. The
    message is the reason, kept in ``history.info["stopped_early"]``."""


@dataclass(kw_only=True)
class EarlyStopping:
    """Stop when ``metric`` has not improved by more than ``min_delta`` for ``patience``
    epochs in a row (Prechelt 1998; Keras' and Lightning's rule). ``mode``: "min" for
    losses, "max" for scores, "auto": "max" for names with accuracy, r2 or score in them,
    else "min".

    Its state (the best value, its epoch, the epochs waited since) is read from the fit's
    history each time it is called, as Lightning restores its own from a checkpoint: a
    resumed fit (``resume=True``, a new process and a new instance) stops at the epoch
    the uninterrupted fit stops at, and one instance passed to several fits (a sweep)
    judges each on its own epochs. Called without a history (by hand), it counts the
    values it is given."""

    metric: str = "eval_loss"
    patience: int = 3
    min_delta: float = 0.0
    mode: str = "auto"
    best: float | None = field(default=None, init=False)
    best_epoch: int | None = field(default=None, init=False)
    waited: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"EarlyStopping(metric={self.metric!r}): name an epoch metric")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int):
            raise ConfigError(f"EarlyStopping(patience={self.patience!r}): must be an int >= 1")
        if self.patience < 1:
            raise ConfigError(f"EarlyStopping(patience={self.patience}): must be >= 1")
        _check_min_delta("EarlyStopping", self.min_delta)
        self.mode = metric_mode("EarlyStopping", self.metric, self.mode)

    def __call__(self, epoch: Mapping[str, Any], history: Any = None) -> None:
        if epoch.get(self.metric) is None:  # not evaluated this epoch (Evaluate(every_
            return  # epochs=...)): the fit checked the name before it began (check_callbacks)
        records = epochs_until(history, epoch)
        if records is not None:  # the fit's epochs so far, this one last: counted afresh
            self.best, self.best_epoch, self.waited = None, None, 0
        for record in [epoch] if records is None else records:
            self._count(record)
        if self.waited >= self.patience:
            best = "no finite value" if self.best is None else f"{self.best:.6g}"
            raise StopTraining(
                f"{self.metric} has not improved on {best} (epoch {self.best_epoch}) for "
                f"{self.waited} epochs"
            )

    def _count(self, record: Mapping[str, Any]) -> None:
        value = record.get(self.metric)
        if value is None:
            return
        if improves(float(value), self.best, self.mode, self.min_delta):
            self.best, self.best_epoch, self.waited = float(value), record.get("epoch"), 0
        else:
            self.waited += 1  # no better, or not finite


@dataclass(frozen=True)
class KeepBest:
    """Keep the weights of the epoch with the best ``metric``: ``fit(keep_best=...)``
    (a metric's name is short for ``KeepBest(metric=name)``). The fit's result has them
    as ``result.best_model``, and with a ``checkpoint_dir`` they are written to
    ``best.pt`` there (:func:`dataflow.checkpoint.load_best`). ``mode`` and ``min_delta``
    as :class:`EarlyStopping`'s: a later epoch replaces the kept one only when better by
    more than ``min_delta``; a value that is not finite never does."""

    metric: str = "eval_loss"
    _: KW_ONLY
    mode: str = "auto"
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"KeepBest(metric={self.metric!r}): name an epoch metric")
        _check_min_delta("KeepBest", self.min_delta)
        object.__setattr__(self, "mode", metric_mode("KeepBest", self.metric, self.mode))

    def improves(self, value: float, best: float | None) -> bool:
        """Whether ``value`` replaces the kept epoch's ``best`` (None: nothing kept)."""
        return improves(value, best, self.mode, self.min_delta)


def epochs_until(history: Any, epoch: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The epoch records of ``history`` before ``epoch`` (by number), then ``epoch``
    itself; None when there is no history to read (a callback called by hand)."""
    records = getattr(history, "epochs", None)
    number = epoch.get("epoch")
    if records is None or number is None:
        return None
    earlier = {int(r["epoch"]): r for r in records if int(r["epoch"]) < int(number)}
    return [earlier[k] for k in sorted(earlier)] + [epoch]


def metric_mode(owner: str, metric: str, mode: str) -> str:
    """``mode`` checked: "min" or "max"; "auto" is "max" for names with accuracy, acc,
    r2 or score in them, else "min"."""
    if mode not in ("auto", "min", "max"):
        raise ConfigError(f"{owner}(mode={mode!r}): use 'min', 'max' or 'auto'")
    if mode != "auto":
        return mode
    higher = ("accuracy", "acc", "r2", "score")
    return "max" if any(word in metric.lower() for word in higher) else "min"


def _check_min_delta(owner: str, delta: Any) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not delta >= 0:
        raise ConfigError(f"{owner}(min_delta={delta!r}): must be a number >= 0")


def improves(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """Whether ``value`` is finite and better than ``best`` by more than ``min_delta``
    (lower for ``mode="min"``, higher for "max"); any finite value beats None."""
    if not math.isfinite(value):
        return False
    sign = 1.0 if mode == "min" else -1.0
    return best is None or sign * (best - value) > min_delta


def as_keep_best(keep_best: Any, epoch_keys: Iterable[str]) -> KeepBest | None:
    """``fit(keep_best=...)`` as a :class:`KeepBest` (None: nothing kept), refused early
    when no epoch record will have its metric."""
    if keep_best is None:
        return None
    if isinstance(keep_best, str):
        keep_best = KeepBest(metric=keep_best)
    if not isinstance(keep_best, KeepBest):
        raise ConfigError(
            f"fit(keep_best={keep_best!r}): name an epoch metric, e.g. keep_best='eval_loss', "
            "or give dataflow.KeepBest(metric=..., mode=...)"
        )
    _check_metric("KeepBest", keep_best.metric, set(epoch_keys))
    return keep_best


def _check_metric(owner: str, metric: str, keys: set[str]) -> None:
    if metric in keys:
        return
    close = difflib.get_close_matches(metric, sorted(keys), n=1)
    hint = (
        f"did you mean {close[0]!r}?"
        if close
        else "evaluate on held-out data (Pipeline(eval_source=...)) for eval_* metrics, or "
        "watch 'train_loss'"
    )
    raise ConfigError(
        f"{owner}(metric={metric!r}): the fit's epochs will have {sorted(keys)}; {hint}"
    )


def check_callbacks(on_epoch: Any, epoch_keys: Iterable[str]) -> tuple[EpochCallback, ...]:
    """``on_epoch`` as a tuple of callables, refused early: not callable, or an
    :class:`EarlyStopping` watching a metric no epoch record will have (``epoch_keys``)."""
    if on_epoch is None:
        return ()
    callbacks = tuple(on_epoch) if isinstance(on_epoch, list | tuple) else (on_epoch,)
    keys = set(epoch_keys)
    for callback in callbacks:
        if not callable(callback):
            raise ConfigError(
                f"fit(on_epoch={callback!r}): give a function of (epoch, history), or a list "
                "of them, e.g. on_epoch=lambda epoch, history: print(epoch)"
            )
        if isinstance(callback, EarlyStopping):
            _check_metric("EarlyStopping", callback.metric, keys)
    return callbacks
