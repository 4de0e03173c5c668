"""Class labels checked as they are read: a label the model has no class for names its sample.

torch finds such a label only inside the loss: ``IndexError: Target 7 is out of bounds`` on
the CPU, naming no sample and no source, and on CUDA a device-side assert that poisons the
worker's process. The dry run learns what a valid label is (:func:`label_check_for`): the
model's output has the classes along dimension 1, and the loss indexes them by the label
when it takes label 0 and refuses label C. ``Load`` then checks every batch on the host,
before it goes to the device (:meth:`LabelCheck.check`): one vectorised comparison per
batch. A value outside ``[0, C)`` that the loss takes (its ``ignore_index``, -100 for
``cross_entropy``) passes; the loss is asked once per such value, on one sample of zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dataflow.core.errors import DataError, LossError

__all__ = [
    "LabelCheck",
    "LabelError",
    "describe_targets",
    "float_label_error",
    "label_check_for",
    "loss_call",
]

# Probed at once by the dry run, so a message can list it: torch's default ignore_index
TORCH_IGNORE_INDEX = -100
_SHOWN = 5  # sample indices listed when a batch holds several bad labels


class LabelError(DataError):
    """A class label the model has no class for; names the sample, the value and the source.

    ``index`` (the sample's index in the source), ``value``, ``classes`` and ``source`` are
    also attributes of the error."""


def describe_targets(source: Any) -> str:
    """Where ``source``'s labels are read from, for a message: the zarr store and array, or
    the in-memory arrays."""
    from dataflow.io.array_source import ArraySource
    from dataflow.io.zarr_source import ZarrSource, _label

    if isinstance(source, ZarrSource):
        where = _label(source.store)
        if isinstance(source.store, (str, Path)) or hasattr(source.store, "store_path"):
            where = f"the zarr store {where!r}"
        elif where.startswith("split of "):  # a split made in xarray (io.xarray_slices)
            where = f"the {where}"
        return f"array {source.y_name!r} of {where}"
    if isinstance(source, ArraySource):
        return f"y of {source!r}"
    return f"the targets of {source!r}"


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


@dataclass(eq=False)
class LabelCheck:
    """Valid labels: ``0 .. classes - 1``, and the values outside that the loss takes."""

    classes: int
    source: str  # describe_targets(the fit's source)
    loss: Callable[..., Any]
    output_tail: tuple[int, ...] = ()  # output dimensions after the classes (per pixel)
    output_dtype: torch.dtype = torch.float32
    # Values outside [0, classes) asked of the loss: whether it takes them
    taken: dict[int, bool] = field(default_factory=dict)

    def takes(self, value: int) -> bool:
        """Whether the loss takes ``value`` as the label of a one-sample batch of zeros
        (asked once per value; a loss that raises, or warns under -W error, refuses it)."""
        if value not in self.taken:
            output = torch.zeros((1, self.classes, *self.output_tail), dtype=self.output_dtype)
            label = torch.full((1, *self.output_tail), value, dtype=torch.int64)
            try:
                with torch.no_grad():
                    self.loss(output, label)
            except Exception:
                self.taken[value] = False
            else:
                self.taken[value] = True
        return self.taken[value]

    def ignored(self) -> list[int]:
        return sorted(v for v, ok in self.taken.items() if ok and not 0 <= v < self.classes)

    def check(self, y: Any, indices: Sequence[int] | np.ndarray | None) -> None:
        """Raise :class:`LabelError` if a label of ``y`` (host memory; sample ``i`` read
        from ``indices[i]`` of the source) is no class of the model."""
        if not isinstance(y, torch.Tensor) or not _is_integer(y) or y.device.type != "cpu":
            return
        if y.numel() == 0:
            return
        low, high = torch.aminmax(y)  # one pass, no mask: the usual case ends here
        if int(low) >= 0 and int(high) < self.classes:
            return
        outside = (y < 0) | (y >= self.classes)
        refused = [v for v in torch.unique(y[outside]).tolist() if not self.takes(int(v))]
        if refused:
            wrong = torch.isin(y, torch.tensor(refused, dtype=y.dtype))
            raise self._error(y, wrong, indices)

    def _error(self, y: torch.Tensor, wrong: torch.Tensor, indices: Any) -> LabelError:
        rows = wrong.reshape(len(y), -1).any(dim=1).nonzero().flatten().tolist()
        row = rows[0]
        flat = int(wrong[row].reshape(-1).nonzero()[0, 0])
        value = int(y[row].reshape(-1)[flat])

        def name(r: int) -> int | str:
            return int(indices[r]) if indices is not None else f"at position {r} of the batch"

        index = name(row)
        where = f"sample {index}" if indices is not None else f"the sample {index}"
        if y.ndim > 1:  # a label per pixel: where in the sample
            where += (
                f" (label position {tuple(int(i) for i in np.unravel_index(flat, y.shape[1:]))})"
            )
        ignored = self.ignored()
        also = f", or {', '.join(map(str, ignored))} (which the loss ignores)" if ignored else ""
        others = ""
        if len(rows) > 1:
            shown = ", ".join(str(name(r)) for r in rows[1:_SHOWN])
            more = "" if len(rows) <= _SHOWN else f" and {len(rows) - _SHOWN} more"
            others = f" Other samples of the same batch with such labels: {shown}{more}."
        if value >= self.classes:
            fix = (
                f"fix the label at the source (relabel or drop sample {index}), or, if the data "
                f"has {value + 1} or more classes, give the model that many outputs (the size "
                "of its output's dimension 1)"
            )
        else:
            fix = (
                f"fix the label at the source (relabel or drop sample {index}); to have the "
                f"loss skip a sample, give it the loss's ignore_index ({TORCH_IGNORE_INDEX} "
                "for torch's cross_entropy and nll_loss)"
            )
        error = LabelError(
            f"label {value} of {where} in {self.source} is not a class of the model: valid "
            f"labels are 0 to {self.classes - 1} (the model's output has {self.classes} "
            f"classes along dimension 1){also}; {fix}.{others}"
        )
        error.index, error.value, error.classes, error.source = (
            index,
            value,
            self.classes,
            self.source,
        )
        return error


def loss_call(loss: Any) -> str:
    """How a message writes a call of ``loss``: ``F.cross_entropy`` (``F`` being
    ``torch.nn.functional``), ``torch.nn.CrossEntropyLoss()``, ``my_loss``."""
    if isinstance(loss, torch.nn.Module):
        torch_own = type(loss).__module__.startswith("torch.nn")
        return f"{'torch.nn.' if torch_own else ''}{type(loss).__name__}()"
    name = getattr(loss, "__name__", type(loss).__name__)
    if getattr(loss, "__module__", None) == "torch.nn.functional":
        return f"F.{name}"
    return name


def float_label_error(
    loss: Callable[..., Any], output: Any, y: Any, error: BaseException, source: str | None = None
) -> LossError | None:
    """Why ``loss(output, y)`` failed when ``y`` are class labels held as floats (torch:
    'expected target dtype to be Long or Byte, but got Float', naming neither the targets
    nor the cast), or None: float targets shaped like class labels (the output without its
    dimension 1) that the loss takes once cast to int64."""
    if not (isinstance(output, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None
    if not y.is_floating_point() or output.ndim < 2:
        return None
    if tuple(y.shape) != (output.shape[0], *output.shape[2:]):
        return None
    try:
        with torch.no_grad():
            loss(output, y.long())
    except Exception:
        return None  # not the dtype: let the loss's own error through
    dtype = str(y.dtype).removeprefix("torch.")
    whole = bool(torch.equal(y, y.round())) if y.numel() else True
    values = "" if whole else " (and some are not whole numbers: check they are class indices)"
    name = getattr(loss, "__name__", type(loss).__name__)
    where = source or "y (the source's targets)"
    return LossError(
        f"loss function {name!r} takes class labels as integers, but {where} holds "
        f"{dtype} labels of shape {tuple(y.shape)}{values}; cast them to int64 where they "
        "are made: ArraySource(x, y.astype('int64')) (a zarr store: write it again with "
        "dataflow.io.to_zarr(path, x, y.astype('int64'))), or in the loss: "
        f"loss=lambda out, y: {loss_call(loss)}(out, y.long()). "
        f"torch said: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    )


def label_check_for(
    loss: Callable[..., Any], output: Any, y: Any, source: str
) -> LabelCheck | None:
    """The check of class labels for ``loss(output, y)``, or None when ``y`` are no class
    labels: integer targets shaped like the output without its dimension 1 (``(N,)`` for
    ``(N, C)`` logits, ``(N, H, W)`` for ``(N, C, H, W)``), and a loss that takes label 0
    and refuses label C (cross_entropy, nll_loss, a function calling them ...)."""
    if not (isinstance(output, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None
    if not output.is_floating_point() or not _is_integer(y) or output.ndim < 2:
        return None
    if tuple(y.shape) != (output.shape[0], *output.shape[2:]):
        return None
    check = LabelCheck(
        classes=int(output.shape[1]),
        source=source,
        loss=loss,
        output_tail=tuple(int(n) for n in output.shape[2:]),
        output_dtype=output.dtype,
    )
    if not check.takes(0) or check.takes(check.classes):
        return None  # no loss of class indices, or one this probe cannot tell
    check.takes(TORCH_IGNORE_INDEX)  # known from the start: the message can list it
    return check
