"""What a fit measured and how it is shown: the typed records of each step, epoch and
phase (:mod:`~dataflow.history.records`), the :class:`History` and :class:`FitResult`
a fit returns (:mod:`~dataflow.history.result`), and the training report drawn from
them (:mod:`~dataflow.history.report`)."""

from __future__ import annotations

from dataflow.history.result import FitResult, History

__all__ = ["FitResult", "History"]
