"""The dry run's watch on class labels: it learns which labels are valid, checks its own
samples' labels before the loss sees them, and hands the check to ``Load`` for the workers;
class labels held as floats fail here naming the source and the cast.

The dry run's graph is a shallow copy of the fit's: each ``Forward`` of the copy gets the
loss wrapped (:class:`WatchedLoss`), which at its first call derives the
:class:`dataflow.io.labels.LabelCheck` from the output and the targets and checks these
targets. The fit's own ``Load`` (pickled to the workers after the dry run) gets the check
unless a ``Transform(apply_to="y")`` changes the labels between reading and the loss: its
input labels are not the ones the loss takes.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from dataflow.core.step import StepSpec
from dataflow.graph import Graph
from dataflow.io.labels import (
    LabelCheck,
    describe_targets,
    float_label_error,
    label_check_for,
)
from dataflow.stages import Forward, Load, Transform

__all__ = ["LabelWatch", "WatchedLoss", "watch_labels"]


@dataclasses.dataclass
class LabelWatch:
    """What the dry run learns of the labels; ``check`` stays None for other targets."""

    source: str
    indices: Any  # the dry run's samples, as indices in the source
    y_transformed: bool = False
    seen: bool = False
    check: LabelCheck | None = None

    def for_workers(self) -> LabelCheck | None:
        """The check ``Load`` makes on every batch, or None."""
        return None if self.y_transformed else self.check


class WatchedLoss:
    """``loss(output, y)``, whose first call derives the label check and checks ``y``
    before the loss runs. It passes for the loss in ``compute_loss``'s messages (its
    name and signature are the loss's)."""

    def __init__(self, loss: Callable[..., Any], watch: LabelWatch) -> None:
        self.loss, self.watch = loss, watch
        self.__name__ = getattr(loss, "__name__", type(loss).__name__)
        fn = loss.forward if isinstance(loss, torch.nn.Module) else loss
        try:
            self.__signature__: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self.__signature__ = None

    def __call__(self, output: Any, *args: Any, **kwargs: Any) -> Any:
        watch = self.watch
        if len(args) == 1 and not kwargs and not watch.seen:
            watch.seen = True
            watch.check = label_check_for(self.loss, output, args[0], watch.source)
            if watch.check is not None:
                watch.check.check(args[0], watch.indices)
            try:
                return self.loss(output, *args)
            except RuntimeError as exc:  # float class labels: name the source and the cast
                error = float_label_error(self.loss, output, args[0], exc, watch.source)
                if error is None:
                    raise
                raise error from exc
        return self.loss(output, *args, **kwargs)


def watch_labels(graph: Graph, load: Load, step: StepSpec, seed: int) -> LabelWatch:
    """Wrap the loss of every ``Forward`` of ``graph`` (the dry run's copy) in a watch of
    the labels of ``step`` (its one step)."""
    _, parts = next(iter(load.streams([step], seed)))
    watch = LabelWatch(source=describe_targets(load.source), indices=parts[0])
    for stage in graph:
        if isinstance(stage, Forward):
            watched = WatchedLoss(stage.config.loss, watch)
            stage.config = dataclasses.replace(stage.config, loss=watched)
        elif isinstance(stage, Transform) and stage.config.apply_to == "y":
            watch.y_transformed = True
    return watch
