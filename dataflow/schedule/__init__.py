"""Batch-size schedules: what global batch and learning rate each phase uses, and how
each phase's batch is split over the replicas (:mod:`dataflow.schedule.balance`).

A phase is a run of epochs with one global batch size ``B``, one learning rate
and one set of replicas. The engine asks the schedule for the next phase at each
phase boundary, so adaptive schedules can decide from what was measured. An
``LRDecay`` (:mod:`dataflow.schedule.decay`) puts a warmup and a decay over the whole fit
on top of the phases' LRs.

Pure: importing this package loads no torch, Dask or zarr (the driver's state machine
and the planner use it).
"""

from __future__ import annotations

# PhaseSpec, PhaseMeasurement, lr_at and the Schedule protocol live in dataflow.core
# (stages use them too); this package is their public home.
from dataflow.core.phase import PhaseMeasurement, PhaseSpec, lr_at
from dataflow.core.protocols import Schedule
from dataflow.schedule import balance
from dataflow.schedule.adaptive import ADAPTIVE_LR_RULES, Adaptive
from dataflow.schedule.decay import CosineDecay, LRDecay, PolynomialDecay, StepDecay, Warmup
from dataflow.schedule.rules import LR_RULES
from dataflow.schedule.static import STEPWISE_LR_RULES, Fixed, Stepwise

__all__ = [
    "ADAPTIVE_LR_RULES",
    "LR_RULES",
    "STEPWISE_LR_RULES",
    "Adaptive",
    "CosineDecay",
    "Fixed",
    "LRDecay",
    "PhaseMeasurement",
    "PhaseSpec",
    "PolynomialDecay",
    "Schedule",
    "StepDecay",
    "Stepwise",
    "Warmup",
    "balance",
    "lr_at",
]
