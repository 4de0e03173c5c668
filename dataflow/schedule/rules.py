"""What the schedules share: the LR scaling rules and the checks of their fields."""

from __future__ import annotations

import math

from dataflow.core.errors import BatchSizeError, ConfigError

LR_RULES = {
    "linear": lambda ratio: ratio,
    "sqrt": lambda ratio: ratio**0.5,
    "none": lambda ratio: 1.0,
}


def _check_lr(owner: str, lr: object) -> None:
    """A base LR is a finite number > 0, or None (the optimizer factory's)."""
    if lr is not None and (
        isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0
    ):
        raise ConfigError(f"{owner}(lr={lr!r}): lr must be a number > 0, or None")


def _positive_int(owner: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BatchSizeError(f"{owner}: {field} must be a positive int, got {value!r}")
    return value


def _finite_number(owner: str, field: str, value: object) -> float:
    """``value`` as a float, or a ``ConfigError`` naming ``owner(field=...)``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{owner}({field}={value!r}): must be a finite number")
    return float(value)


def _round_down(value: int, multiple: int) -> int:
    return value // multiple * multiple
