"""Scale-invariant progress: training counted in epochs at the first batch ``B0``.

AdaScale (Johnson et al. 2020) counts "scale-invariant iterations": one step at batch
``B`` with gain ``r`` (:func:`dataflow.schedule.noise_scale.adascale_gain`, between 1
and ``B/B0``) is worth ``r`` steps at ``B0``. An epoch of data at ``B`` has ``N/B``
steps, so it makes ``r·B0/B`` epochs of progress: all of an epoch while the noise
dominates (``r = B/B0``), less once the batch is well above the noise scale. A
schedule that counts progress runs each phase for as many data epochs as its progress
needs, so a larger batch trains longer instead of stopping short: the fix for a task
that is still learning when the batch grows (a step-limited one), at the price of more
epochs (which more workers pay for).

Pure arithmetic: no torch, no Dask.
"""

from __future__ import annotations

import math

from dataflow.core.phase import PhaseSpec
from dataflow.schedule.noise_scale import adascale_gain

# Progress within this of a boundary counts as at it (float sums of per-epoch rates)
PROGRESS_TOLERANCE = 1e-9


def progress_per_epoch(gain: float, base_batch: int, batch: int) -> float:
    """Epochs of progress (at ``base_batch``) one epoch of data at ``batch`` makes, at
    statistical gain ``gain``: ``gain·B0/B``."""
    return gain * base_batch / batch


def epochs_for_progress(progress: float, per_epoch: float) -> int:
    """The whole epochs of data that make at least ``progress`` at ``per_epoch`` a data
    epoch (at least one: a phase is never empty)."""
    return max(1, math.ceil(progress / per_epoch - PROGRESS_TOLERANCE))


def progress_made(done: float, total: float) -> bool:
    """Whether ``done`` epochs of progress reach the fit's ``total`` (no phase left)."""
    return done >= total - PROGRESS_TOLERANCE


def phase_progress(
    done: float, target: float, gain: float, base_batch: int, batch: int, most: int | None = None
) -> tuple[int, dict[str, float]]:
    """A phase at ``batch`` and ``gain`` that starts at ``done`` epochs of progress: its
    epochs of data (the whole epochs that reach ``target``, at most ``most``) and the
    ``PhaseSpec`` fields of the progress before and after it."""
    per_epoch = progress_per_epoch(gain, base_batch, batch)
    epochs = epochs_for_progress(target - done, per_epoch)
    if most is not None:
        epochs = min(epochs, most)
    return epochs, {"progress_start": done, "progress_end": done + epochs * per_epoch}


def statistical_gain(
    noise_scale: float | None, base_batch: int, batch: int, previous: PhaseSpec | None
) -> float:
    """The gain ``r`` a phase at ``batch`` is credited with: AdaScale's at the trusted
    noise scale (``math.inf``, an unresolved ``|G|²``: ``B/B0``); without an estimate,
    the previous phase's (1 for the first phase, at ``B0`` itself). For the
    "adascale-sqrt" rule too: its LR takes the gain's square root, its progress the gain."""
    if noise_scale is not None:
        return adascale_gain(noise_scale, base_batch, batch)
    if previous is None or previous.progress_start is None or previous.progress_end is None:
        return 1.0
    epochs = previous.end_epoch - previous.start_epoch
    per_epoch = (previous.progress_end - previous.progress_start) / epochs
    return per_epoch * previous.global_batch / base_batch


def progress_so_far(previous: PhaseSpec | None) -> float:
    """The progress made before the next phase: the previous phase's end (0 at first)."""
    if previous is None:
        return 0.0
    if previous.progress_end is None:
        raise ValueError(
            f"phase {previous.index} counted no progress: a fit that counts it cannot "
            "follow one that did not (resume it with the schedule it was started with)"
        )
    return previous.progress_end
