"""``dataflow convert SRC.zarr DEST.zarr --dtype x=int16``: arrays stored in a narrower
dtype, each value checked on the way.

Large fields stream from zarr at the rate their bytes decode: counts held as float32
(particle counts, detector hits) are read twice as fast stored as int16, and scaled on
the device (``Transform(Log1p(dtype=torch.float32))``). The copy must be the same data:
to an integer dtype every value must be a whole number within the dtype's range, to a
floating one every finite value must stay finite. A value that breaks this stops the
copy, naming the array, the element and the fix; nothing narrowed is written silently
wrong. A float narrowed to float16 rounds to its 11 significant bits: the largest
relative change is reported, not refused (the user asked for float16).

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError, DataError

NARROW = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "float32")


def parse_dtypes(spec: str | Mapping[str, Any] | None) -> dict[str, np.dtype]:
    """``"x=int16,mask=uint8"`` or ``{"x": "int16"}`` as ``{array: dtype}``, each dtype one
    of :data:`NARROW`; None: no change."""
    how = (
        "give ARRAY=DTYPE pairs separated by commas, e.g. --dtype x=int16 (DTYPE one of "
        f"{', '.join(NARROW)})"
    )
    if spec is None:
        return {}
    if isinstance(spec, str):
        pairs = [part.partition("=") for part in spec.replace(" ", "").split(",")]
        if not all(name and sep and dtype for name, sep, dtype in pairs):
            raise ConfigError(f"convert(--dtype {spec}): name the array for each dtype; {how}")
        items = [(name, dtype) for name, _, dtype in pairs]
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        raise ConfigError(f"convert(dtypes={spec!r}): {how}")
    parsed: dict[str, np.dtype] = {}
    for name, dtype in items:
        if str(dtype) not in NARROW:
            raise ConfigError(f"convert(--dtype {name}={dtype}): {how}")
        parsed[str(name)] = np.dtype(str(dtype))
    if not parsed:
        raise ConfigError(f"convert(--dtype {spec!r}): {how}")
    return parsed


def check_castable(name: str, source: np.dtype, target: np.dtype) -> None:
    """Refuse a dtype change no value check can make safe: from a non-numeric or complex
    array."""
    if np.dtype(source).kind not in "biuf":
        raise ConfigError(
            f"convert(--dtype {name}={target}): array {name!r} is {source}; only integer, "
            "float and bool arrays are stored narrower"
        )


def narrowed(
    name: str, values: np.ndarray, target: np.dtype, corner: tuple[int, ...]
) -> tuple[np.ndarray, float]:
    """``values`` (a slab of array ``name`` starting at ``corner``) cast to ``target``,
    checked, and the largest relative change of a value (0.0 when exact). Raises
    ``DataError`` naming the first value that does not fit."""
    target = np.dtype(target)
    if target.kind in "iu":
        return _to_integer(name, values, target, corner), 0.0
    with np.errstate(over="ignore"):  # an overflow is found below, and named
        out = values.astype(target)
    overflow = np.isfinite(values) & ~np.isfinite(out)
    if overflow.any():
        where = _where(overflow, corner)
        raise DataError(
            f"convert(--dtype {name}={target}): {name}{list(where)} = "
            f"{values[_local(overflow)]!r} does not fit in {target} (largest "
            f"{np.finfo(target).max:g}); nothing was written. Keep {values.dtype}, or scale "
            "the array first"
        )
    return out, _relative(values, out)


def _relative(values: np.ndarray, out: np.ndarray) -> float:
    """The largest ``|out - values| / |values|`` over the finite, non-zero values."""
    finite = np.isfinite(values) & (values != 0)
    if not finite.any():
        return 0.0
    wide = values[finite].astype(np.float64)
    return float(np.max(np.abs(out[finite].astype(np.float64) - wide) / np.abs(wide)))


def _to_integer(
    name: str, values: np.ndarray, target: np.dtype, corner: tuple[int, ...]
) -> np.ndarray:
    info = np.iinfo(target)
    if values.dtype.kind == "f":
        bad = not_whole(values)
        if bad.any():
            raise DataError(
                f"convert(--dtype {name}={target}): {name}{list(_where(bad, corner))} = "
                f"{values[_local(bad)]!r} is not a whole number, so {target} cannot hold it "
                f"and nothing was written. Keep {values.dtype} (or --dtype {name}=float16 "
                "if its precision is enough)"
            )
    low, high = values.min(initial=info.min), values.max(initial=info.max)
    if low < info.min or high > info.max:
        bad = (values < info.min) | (values > info.max)
        raise DataError(
            f"convert(--dtype {name}={target}): {name}{list(_where(bad, corner))} = "
            f"{values[_local(bad)]!r} is outside {target}'s range [{info.min}, {info.max}]; "
            "nothing was written. Choose a wider integer dtype"
        )
    return values.astype(target)


def not_whole(values: np.ndarray) -> np.ndarray:
    """Where ``values`` are not whole numbers an integer dtype could hold: fractions,
    NaN and infinities."""
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(values) | (values != np.round(values))


def _local(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _where(mask: np.ndarray, corner: tuple[int, ...]) -> tuple[int, ...]:
    """The first flagged element's index in the whole array."""
    return tuple(c + i for c, i in zip(corner, _local(mask), strict=True))


def fill_value_as(fill: Any, target: np.dtype) -> Any:
    """The source's fill value in ``target``: itself where it fits, else 0 (an integer
    dtype cannot hold NaN). The copy writes every chunk, so the fill value is never read
    as data (an absent chunk is refused)."""
    if fill is None:
        return None
    target = np.dtype(target)
    try:
        value = np.asarray(fill).astype(np.float64)
    except (TypeError, ValueError):
        return 0
    if target.kind in "iu":
        info = np.iinfo(target)
        ok = not not_whole(value) and info.min <= value <= info.max
        return int(value) if ok else 0
    return target.type(value)


def narrower_integer(dtype: Any, low: float, high: float) -> np.dtype | None:
    """The smallest integer dtype of :data:`NARROW` that holds whole numbers in
    ``[low, high]``, if it has fewer bytes than ``dtype``; else None (``dataflow info``'s
    suggestion for floats that hold counts)."""
    for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32"):
        candidate = np.dtype(name)
        info = np.iinfo(candidate)
        if info.min <= low and high <= info.max:
            return candidate if candidate.itemsize < np.dtype(dtype).itemsize else None
    return None
