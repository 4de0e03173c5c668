"""Per-variable mean and std of a store's arrays, measured once and kept beside the run.

Standardising inputs needs statistics of the whole field, not of a sample of windows
(overlapping windows count a cell many times, and a random sample misses rare
regions). :func:`normalization_stats` reads each stored chunk of each variable once
(threads decode several at a time, a bounded number held), accumulates count, mean
and the sum of squared deviations in float64 (chunks combined exactly, as in Chan et
al.'s parallel update), and leaves NaN out (as ``PatchSource(nan="mask")`` reads them:
not data). With ``path`` the result is written as JSON and read back on the next call
whose store and variables match: a fingerprint of each array's name, shape, chunks
and dtype, the store's label, and the values of three of its chunks (the first, the
middle and the last: a store written again with other values or other CF packing is
measured again, for three chunk reads, not a pass over the store); ``refresh=True``
measures again whatever the fingerprint says.
``dataflow.ops.Standardize.from_stats(stats, source)`` applies them on the device, one
mean and std per channel of the source's samples (:meth:`NormalizationStats.per_channel`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError, DataError
from dataflow.io.cf_stores import cf_decoded
from dataflow.io.patch_arrays import (
    PatchArray,
    is_single_array,
    open_member,
    open_single,
    open_store,
)
from dataflow.io.windows import box_chunks
from dataflow.io.xarray_backing import raw_zarr

log = logging.getLogger(__name__)

FILE_NAME = "normalization.json"  # written in a run's folder when ``path`` is one
THREADS = 8  # chunks read at once (decode and, for an object store, requests in flight)
SLAB_BYTES = 64 * 2**20  # an array without storage chunks is read in slabs of this much


@dataclass(frozen=True)
class NormalizationStats:
    """Per variable (in ``variables`` order): ``mean``, ``std`` (population, ddof=0)
    and ``count`` (non-NaN values) over the whole array; ``fingerprint`` says which
    store and arrays they describe."""

    variables: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    count: tuple[int, ...]
    fingerprint: str

    def per_channel(self, source: Any = None) -> tuple[list[float], list[float]]:
        """The (mean, std) of each channel, what ``dfl.ops.Standardize.from_stats``
        applies. Without ``source``: one channel per variable. With a ``PatchSource``
        whose x is these variables: its channels, each variable's statistics repeated
        over the dims folded into its channels, and mean 0, std 1 for the mask channel
        of ``nan="mask"`` (left as it is)."""
        mean, std = list(self.mean), list(self.std)
        if source is not None:
            names = _x_names(source)
            if names != [None] and names != list(self.variables):
                raise ConfigError(
                    f"Standardize.from_stats(stats, source): the statistics are of "
                    f"{list(self.variables)} but the source's x is {names}; measure them "
                    "for the source's variables (normalization_stats(source))"
                )
            geometry = getattr(source, "geometry", None)
            if geometry is not None:
                per = geometry.sample_shape[0] // len(names)
                mean = [m for m in mean for _ in range(per)]
                std = [s for s in std for _ in range(per)]
                if getattr(source, "nan", None) == "mask":
                    mean, std = [*mean, 0.0], [*std, 1.0]
        return mean, std

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> NormalizationStats:
        raw = json.loads(Path(path).read_text())
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def normalization_stats(
    source_or_store: Any,
    variables: str | Sequence[str] | None = None,
    path: str | os.PathLike | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    refresh: bool = False,
) -> NormalizationStats:
    """Mean and std of each of ``variables`` (default: the source's x arrays) over the
    whole store, in one streaming pass over its chunks.

    ``source_or_store``: a ``PatchSource`` or ``ZarrSource`` (its store and storage
    options), or what ``PatchSource`` takes as a store. ``path``: a JSON file, or a
    folder (the run's) to hold ``normalization.json``; statistics found there for the
    same store and variables (and the same values in three sampled chunks) are returned
    without reading the store, unless ``refresh``."""
    store, options = source_or_store, storage_options
    if hasattr(source_or_store, "num_samples") and hasattr(source_or_store, "store"):
        store = source_or_store.store
        options = options or getattr(source_or_store, "storage_options", None)
        if variables is None:
            variables = _x_names(source_or_store)
    names = [variables] if isinstance(variables, str) or variables is None else list(variables)
    arrays, label = _open(store, names, options)
    fingerprint = _fingerprint(label, arrays)
    target = _target(path)
    if target is not None and target.is_file() and not refresh:
        try:
            kept = NormalizationStats.from_json(target)
        except (ValueError, TypeError, KeyError):
            kept = None
        if kept is not None and kept.fingerprint == fingerprint:
            log.info("normalization: reusing %s (same store, variables and sampled chunks)", target)
            return kept
        log.info("normalization: %s describes another store or variables; measuring", target)
    moments = [_moments(array) for array in arrays]
    for array, (count, _, _) in zip(arrays, moments, strict=True):
        if count == 0:
            raise DataError(
                f"normalization_stats: {array.field} ({array.name!r}) of {label} holds no "
                "value that is not NaN; it has no mean to measure"
            )
    stats = NormalizationStats(
        variables=tuple(a.name for a in arrays),
        mean=tuple(float(m) for _, m, _ in moments),
        std=tuple(float(np.sqrt(m2 / n)) for n, _, m2 in moments),
        count=tuple(int(n) for n, _, _ in moments),
        fingerprint=fingerprint,
    )
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        stats.to_json(target)
    return stats


def _x_names(source: Any) -> list[Any]:
    """The source's x array names ([None]: its store is the one array x)."""
    x = getattr(source, "x_name", None)
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _open(store: Any, names: list[Any], options: Any) -> tuple[list[PatchArray], str]:
    named = [n for n in names if n]
    decoded = cf_decoded(store, named, options, "normalization_stats")  # as the sources read
    opened, label = open_store(raw_zarr(decoded, named), options)
    if names == [None]:
        if not is_single_array(opened):
            raise ConfigError(
                f"normalization_stats(variables=None): {label} holds several arrays; name "
                "the variables to measure"
            )
        return [open_single(opened, label)], label
    fields = [f"variables[{i}]" for i in range(len(names))]
    arrays = [
        open_member(opened, f, n, label, caller="normalization_stats")
        for f, n in zip(fields, names, strict=True)
    ]
    return arrays, label


def _fingerprint(label: str, arrays: Sequence[PatchArray]) -> str:
    described = [label] + [
        [a.name, list(a.shape), list(a.unit or ()), a.dtype.str]
        + ([] if a.where is None else [list(a.where)])
        for a in arrays
    ]  # (a split's box: two splits of one shape are two sets of statistics)
    digest = hashlib.sha256(json.dumps(described).encode())
    for array in arrays:  # the values, as read (decoded): a store written again differs
        for box in _sampled_boxes(array):
            digest.update(np.ascontiguousarray(array.read_box(*box)).tobytes())
    return digest.hexdigest()[:16]


def _sampled_boxes(array: PatchArray) -> list[tuple[list[int], list[int]]]:
    """The boxes (as :func:`_boxes` gives them) of the chunks holding the array's first,
    middle and last cell, found without listing every chunk (a store may hold millions)."""
    shape, unit, origin = array.shape, _unit(array), array.origin
    boxes: list[tuple[list[int], list[int]]] = []
    for point in ([0] * len(shape), [s // 2 for s in shape], [s - 1 for s in shape]):
        coords = [(p + o) // u for p, o, u in zip(point, origin, unit, strict=True)]
        lo = [max(0, c * u - o) for c, u, o in zip(coords, unit, origin, strict=True)]
        hi = [
            min(s, (c + 1) * u - o) for c, u, o, s in zip(coords, unit, origin, shape, strict=True)
        ]
        if (lo, hi) not in boxes and all(h > low for low, h in zip(lo, hi, strict=True)):
            boxes.append((lo, hi))
    return boxes


def _target(path: str | os.PathLike | None) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    return path if path.suffix == ".json" else path / FILE_NAME


def _boxes(array: PatchArray) -> list[tuple[list[int], list[int]]]:
    """The array's stored chunks as boxes ``(lo, hi)`` (slabs along axis 0 without); a
    split of a stored array (``origin``): the parts of the stored chunks it holds."""
    shape, unit, origin = array.shape, _unit(array), array.origin
    boxes = []
    for coords in box_chunks(origin, [o + s for o, s in zip(origin, shape, strict=True)], unit):
        lo = [max(0, c * u - o) for c, u, o in zip(coords, unit, origin, strict=True)]
        hi = [
            min(s, (c + 1) * u - o) for c, u, o, s in zip(coords, unit, origin, shape, strict=True)
        ]
        boxes.append((lo, hi))
    return boxes


def _unit(array: PatchArray) -> tuple[int, ...]:
    """The array's stored chunk shape (slabs of ``SLAB_BYTES`` along axis 0 without)."""
    if array.unit is not None:
        return tuple(array.unit)
    shape = array.shape
    row = max(1, int(np.prod(shape[1:], dtype=np.int64)) * array.dtype.itemsize)
    return (max(1, SLAB_BYTES // row), *shape[1:])


def _chunk_moments(data: np.ndarray) -> tuple[int, float, float]:
    values = data.astype(np.float64, copy=False).reshape(-1)
    if np.issubdtype(data.dtype, np.floating):
        values = values[~np.isnan(values)]
    n = len(values)
    if n == 0:
        return 0, 0.0, 0.0
    mean = float(values.mean())
    return n, mean, float(np.square(values - mean).sum())


def _moments(array: PatchArray) -> tuple[int, float, float]:
    """``(count, mean, M2)`` over every stored chunk of ``array``, each read once."""
    count, mean, m2 = 0, 0.0, 0.0
    for n, chunk_mean, chunk_m2 in _each_chunk(array):
        if n == 0:
            continue
        total = count + n
        delta = chunk_mean - mean
        mean += delta * n / total
        m2 += chunk_m2 + delta * delta * count * n / total
        count = total
    return count, mean, m2


def _each_chunk(array: PatchArray) -> Iterator[tuple[int, float, float]]:
    """Each chunk's moments, in order, ``THREADS`` read at once (at most twice that
    many chunks' results waiting)."""
    boxes = _boxes(array)
    with ThreadPoolExecutor(THREADS, thread_name_prefix="dataflow-stats") as pool:
        for start in range(0, len(boxes), 2 * THREADS):
            part = boxes[start : start + 2 * THREADS]
            yield from pool.map(lambda box: _chunk_moments(array.read_box(*box)), part)
