"""Checkpoints: everything a fit needs to resume exactly, in one import.

:class:`Checkpoint` and its format (``dataflow.checkpoint.format``),
:class:`CheckpointStore` (``dataflow.checkpoint.store``: atomic writes with a
checksummed manifest, listing, ``keep``, ``load_latest``), :func:`fingerprint` and
:func:`compare_fingerprints` (``dataflow.checkpoint.fingerprint``: what must match to resume),
:func:`capture_rng` and :func:`restore_rng` (``dataflow.core.rng``), and
:func:`load_best` (``dataflow.checkpoint.best``: the best epoch's weights a fit with
``keep_best=`` wrote).
"""

from dataflow.checkpoint.best import load_best
from dataflow.checkpoint.fingerprint import compare_fingerprints, fingerprint
from dataflow.checkpoint.format import (
    FORMAT_VERSION,
    Checkpoint,
    ledger_from_state,
    ledger_state,
    phase_from_dict,
    phase_to_dict,
    plain_state,
    steps_from_list,
    steps_to_list,
)
from dataflow.checkpoint.store import WRITE_DELAY_ENV, CheckpointStore
from dataflow.core.rng import capture_rng, restore_rng

__all__ = [
    "FORMAT_VERSION",
    "WRITE_DELAY_ENV",
    "Checkpoint",
    "CheckpointStore",
    "capture_rng",
    "compare_fingerprints",
    "fingerprint",
    "ledger_from_state",
    "ledger_state",
    "load_best",
    "phase_from_dict",
    "phase_to_dict",
    "plain_state",
    "restore_rng",
    "steps_from_list",
    "steps_to_list",
]
