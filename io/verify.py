"""Read every chunk of a zarr store once, before a long job trusts it.

A store written elsewhere may carry no checksum (``xarray.Dataset.to_zarr``'s zstd
has none): a chunk whose bytes changed can still decode, to values like 8e37, and
nothing else notices. :func:`verify_store` decodes every chunk of every array (on
the same path training reads: ``io.zarr_decode``, which verifies any checksum the
codecs carry), checks each chunk exists and every value is finite, and flags a chunk
whose largest magnitude is ``outlier_factor`` times that of the typical chunk of
its array (the median over chunks): the range check that catches garbage from a
corrupted chunk without a checksum. It reports per-array min, max and mean.
"""

from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync

from dataflow.core.errors import ConfigError, DataError
from dataflow.io.checksums import checksum_of
from dataflow.io.read_errors import chunk_read_error
from dataflow.io.store_open import open_zarr
from dataflow.io.zarr_decode import MissingObject, ObjectDecodeError, chunk_decoder

OUTLIER_FACTOR = 1e6  # a chunk this many times larger than the typical one is suspect


@dataclass
class _ChunkStats:
    key: str
    count: int = 0
    non_finite: int = 0
    low: float = math.inf
    high: float = -math.inf
    total: float = 0.0
    peak: float = 0.0  # the largest finite magnitude
    problem: str | None = None


@dataclass
class ArrayCheck:
    """One array's verdict: its checksum, value range, and the chunks that failed."""

    name: str
    chunks: int
    checksum: str | None
    min: float | None
    max: float | None
    mean: float | None
    problems: list[str] = field(default_factory=list)


@dataclass
class StoreCheck:
    """:func:`verify_store`'s report; ``ok`` when no chunk failed."""

    path: str
    arrays: list[ArrayCheck]
    outlier_factor: float

    @property
    def problems(self) -> list[str]:
        return [p for a in self.arrays for p in a.problems]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unchecksummed(self) -> list[str]:
        return [a.name for a in self.arrays if a.checksum is None]

    def format(self) -> str:
        chunks = sum(a.chunks for a in self.arrays)
        failed = len(self.problems)
        counted = f"{chunks} chunk(s) of {len(self.arrays)} array(s)"
        done = f"decoded all {counted}" if not failed else f"{counted}, {failed} with a problem"
        lines = [f"verify {self.path}: {done}" + (" (below)" if failed else "")]
        rows = [("array", "chunks", "checksum", "min", "max", "mean")]
        for a in self.arrays:
            values = ("-" if v is None else f"{v:.6g}" for v in (a.min, a.max, a.mean))
            rows.append((a.name, str(a.chunks), a.checksum or "none", *values))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += [
            ("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip()
            for r in rows
        ]
        if self.unchecksummed:
            lines.append(
                f"note: no checksums in {self.unchecksummed}: a corrupted chunk of theirs that "
                "still decodes is caught only by this range check, never while training"
            )
        lines += [f"PROBLEM: {p}" for p in self.problems]
        if self.ok:
            lines.append(
                "OK: every chunk present and decoded, every value finite, no chunk over "
                f"{self.outlier_factor:g}x its array's typical magnitude"
            )
        else:
            lines.append(
                f"FAILED: {len(self.problems)} problem(s) in {self.path}; re-write (or "
                "re-convert) the store, or restore the named chunk files from a copy"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "outlier_factor": self.outlier_factor,
            "arrays": [a.__dict__ for a in self.arrays],
            "problems": self.problems,
        }


def verify_store(
    path: str | Path | zarr.Group | zarr.Array,
    *,
    arrays: list[str] | None = None,
    outlier_factor: float = OUTLIER_FACTOR,
    threads: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> StoreCheck:
    """Decode every chunk of ``arrays`` (default: all) of the store at ``path``; see the
    module docstring. Returns a :class:`StoreCheck` (``.ok``, ``.problems``, ``.format()``);
    raises only when the store cannot be opened. ``outlier_factor=0`` turns the range
    check off (data whose chunks truly differ by that much); ``threads``: decode threads
    (default: min(4, cores)); ``storage_options``: fsspec's, for a URL (as ``ZarrSource``
    takes them)."""
    if not (isinstance(outlier_factor, int | float) and outlier_factor >= 0):
        raise ConfigError(
            f"verify_store(outlier_factor={outlier_factor!r}): a number >= 0 (0: no range check)"
        )
    node = path if isinstance(path, zarr.Group | zarr.Array) else _open(path, storage_options)
    label = str(path.store_path) if isinstance(path, zarr.Group | zarr.Array) else str(path)
    members = _members(node, label, arrays)
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dataflow-verify") as pool:
        checked = [_check_array(name, a, outlier_factor, pool) for name, a in members]
    return StoreCheck(path=label, arrays=checked, outlier_factor=float(outlier_factor))


def _open(path: str | Path, storage_options: dict[str, Any] | None) -> Any:
    if "://" not in str(path) and not Path(path).exists():
        raise DataError(f"verify_store: no zarr store at {str(path)!r}; check the path")
    return open_zarr("verify_store", path, storage_options)


def _members(node: Any, label: str, names: list[str] | None) -> list[tuple[str, zarr.Array]]:
    if isinstance(node, zarr.Array):
        return [(node.basename or "<array>", node)]
    found = {str(n): m for n, m in node.members(max_depth=None) if isinstance(m, zarr.Array)}
    for name in names or []:
        if name not in found:
            raise DataError(
                f"verify_store(arrays=[{name!r}]): no array {name!r} in {label}; "
                f"the arrays there are {sorted(found)}"
            )
    return [(n, found[n]) for n in (names or sorted(found))]


def _check_array(
    name: str, array: zarr.Array, factor: float, pool: ThreadPoolExecutor
) -> ArrayCheck:
    """Every chunk of ``array`` decoded on ``pool``, then the range check across chunks."""
    unit = array.shards or array.chunks
    grid = [range(math.ceil(s / c)) for s, c in zip(array.shape, unit, strict=True)]
    decoder = chunk_decoder(array)
    stats = list(
        pool.map(lambda c: _chunk(array, name, decoder, unit, c), itertools.product(*grid))
    )
    problems = [s.problem for s in stats if s.problem]
    good = [s for s in stats if s.problem is None]
    peaks = [s.peak for s in good if s.count and s.peak > 0]
    typical = float(np.median(peaks)) if len(peaks) > 2 else 0.0
    for s in good:
        if factor and typical and s.peak > factor * typical:
            problems.append(
                f"chunk {s.key!r} of array {name!r}: its largest magnitude {s.peak:.3g} is "
                f"{s.peak / typical:.3g}x the typical chunk's ({typical:.3g}); likely corrupt "
                "bytes that still decoded (or data this skewed: pass outlier_factor=0 / "
                "--outlier-factor 0)"
            )
    count = sum(s.count - s.non_finite for s in good)
    return ArrayCheck(
        name=name,
        chunks=len(stats),
        checksum=checksum_of(array),
        min=min((s.low for s in good if s.count > s.non_finite), default=None),
        max=max((s.high for s in good if s.count > s.non_finite), default=None),
        mean=sum(s.total for s in good) / count if count else None,
        problems=problems,
    )


def _chunk(array: zarr.Array, name: str, decoder: Any, unit: Any, coords: tuple) -> _ChunkStats:
    """Decode one stored chunk (or shard) and summarise it; a failure becomes ``problem``."""
    key = array.metadata.encode_chunk_key(coords)
    key = f"{array.path}/{key}" if array.path else key
    region = tuple(
        slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(coords, unit, array.shape, strict=True)
    )
    stats = _ChunkStats(key)
    try:
        if decoder is not None:
            values = np.empty(tuple(r.stop - r.start for r in region), decoder.array.dtype)
            decoder.read(region, values)
        else:  # sharded: zarr reads it, after asking the store whether the shard exists
            if not sync(array.store_path.store.exists(key)):
                raise MissingObject(key)
            values = np.asarray(array[region])
    except MissingObject:
        stats.problem = (
            f"chunk {key!r} of array {name!r} is missing from the store (zarr would read it as "
            "the fill value; ZarrSource refuses it)"
        )
        return stats
    except ObjectDecodeError as exc:
        stats.problem = str(chunk_read_error(array, name, key, exc.error))
        return stats
    except Exception as exc:  # zarr's own read of a sharded array
        stats.problem = str(chunk_read_error(array, name, key, exc))
        return stats
    _summarise(values, stats, name)
    return stats


def _summarise(values: np.ndarray, stats: _ChunkStats, name: str) -> None:
    stats.count = int(values.size)
    if values.size == 0:
        return
    if values.dtype == np.bool_:
        values = values.view(np.uint8)
    if np.issubdtype(values.dtype, np.inexact):
        finite = np.isfinite(values)
        stats.non_finite = int(values.size - np.count_nonzero(finite))
        if stats.non_finite:
            stats.problem = (
                f"chunk {stats.key!r} of array {name!r}: {stats.non_finite} of {values.size} "
                "values are NaN or infinite"
            )
            values = values[finite]
    if values.size == 0:
        return
    stats.low, stats.high = float(values.min()), float(values.max())
    stats.total = float(values.sum(dtype=np.float64))
    stats.peak = max(abs(stats.low), abs(stats.high))
