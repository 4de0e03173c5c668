"""A phase's step time as the driver measured it: the steady step from the window
commits, checked against the replicas' own step times, and the wait lockstep steps
would have had. Pure functions of the recorded times."""

from __future__ import annotations

from typing import Any

import numpy as np

from dataflow.driver.machine import MachineConfig


def steady_step_seconds(
    windows: list[tuple[float, int]],
    skip: int = MachineConfig.calibration_steps + 1,
    step_median: float | None = None,
) -> float | None:
    """A phase's steady step time on the driver's clock: from the commit of window
    ``skip - 1`` to that of the last window, per step committed in between. The phase's
    one-step calibration windows and the first fused window (whose start waits on the
    driver's plan) are left out; so is everything before the first window (setup, the
    phase's start), and the end of the phase. Fewer windows: as many are left out as
    leaves two; one window: None (the caller uses the steps' median). With
    ``step_median`` (the replicas' median step), a window committed with the one before
    it (under half its steps' time after it: the driver took both at once) moves the
    start on past it, while two windows remain: counted from the earlier commit, its
    steps would be counted without their time (24 ms a step where the replicas took 38)."""
    if len(windows) < 2:
        return None
    start = min(skip, len(windows) - 1) - 1
    if step_median is not None and step_median > 0:
        while start + 2 < len(windows):
            (then, _), (now, steps) = windows[start], windows[start + 1]
            if now - then >= 0.5 * steps * step_median:
                break
            start += 1
    steps = sum(n for _, n in windows[start + 1 :])
    seconds = windows[-1][0] - windows[start][0]
    return seconds / steps if steps > 0 and seconds > 0 else None


def plausible_step_seconds(
    steady: float | None, step_seconds: list[float], floor: float = 0.5
) -> tuple[float | None, str | None]:
    """(the phase's measured step, a note when it is not the steady one): the steady
    step on the driver's clock, unless it is under ``floor`` x the replicas' median
    step (the driver cannot see steps faster than the replicas run them: it committed
    windows that had finished together); then, or without one, that median."""
    median = float(np.median(step_seconds)) if step_seconds else None
    if steady is None or median is None or steady >= floor * median:
        return (steady if steady is not None else median), None
    return median, (
        f"the window commits gave {steady:.3g} s a step, under {floor:g} x the replicas' "
        f"median step of {median:.3g} s (windows committed together): implausible, "
        "discarded; the median step is recorded"
    )


def lockstep_wait(step_seconds: Any, store_wait_s: Any = None) -> np.ndarray:
    """Per replica, the seconds it would have waited had every step been lockstep
    (synchronous): at each step, the slowest replica's work less its own, summed.
    ``step_seconds`` is replicas x steps; under asynchronous updates a step's work is
    its time less ``store_wait_s`` (its wait on the parameter store)."""
    seconds = np.array(step_seconds, dtype=float)
    if store_wait_s is not None:
        seconds -= np.array(store_wait_s, dtype=float)
    return (seconds.max(axis=0) - seconds).sum(axis=1)
