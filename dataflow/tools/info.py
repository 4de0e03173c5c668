"""``dataflow info``: what a zarr store holds and how fast this machine can decode it.

For each array: shape, dtype, chunks (and shards), codecs, bytes on disk and in
memory, samples along the sample dimension, and how many of its chunks are
absent from the store (zarr would read them as the fill value; ``ZarrSource``
refuses them). The decode estimate times reading a few whole chunks, spread
over the array, in this process: an upper bound on what one data-loading
replica can feed per second from this disk (the OS cache may be warm). Arrays
whose codecs carry no checksum are named: a corrupted chunk of theirs may still
decode; ``--verify`` (``dataflow.io.verify_store``) reads every chunk to find one.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from dataflow.core.errors import ConfigError, DataError
from dataflow.io.array_readers import ZarrArrayReader
from dataflow.io.checksums import checksum_of
from dataflow.io.store_open import open_zarr
from dataflow.tools.narrowing import narrower_integer, not_whole
from dataflow.tools.storage_flags import storage_flags


@dataclass
class ArrayInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    shards: tuple[int, ...] | None
    codecs: list[str]
    dimension_names: list[str] | None
    bytes_stored: int
    bytes_in_memory: int
    samples: int | None  # None: the array has no sample dimension
    chunks_total: int
    chunks_missing: int | None  # None: not checked
    missing_examples: list[str] = field(default_factory=list)
    decode_samples_per_second: float | None = None
    checksum: str | None = None  # what every decode verifies (io.checksums); None: nothing
    # a float array whose chunks read for the decode estimate held only whole numbers:
    # (the integer dtype that holds them, their least and largest value)
    whole_numbers: tuple[str, float, float] | None = None


@dataclass
class StoreInfo:
    path: str
    zarr_format: int
    sample_dim: str | int
    arrays: list[ArrayInfo]
    flags: str = field(default="", repr=False)  # the storage options for a suggested command

    @property
    def samples(self) -> int | None:
        """The samples every array with the sample dimension agrees on, or None."""
        counts = {a.samples for a in self.arrays if a.samples is not None}
        return counts.pop() if len(counts) == 1 else None

    @property
    def decode_samples_per_second(self) -> float | None:
        """Whole samples (one row of every array with the sample dimension) per second."""
        rates = [a.decode_samples_per_second for a in self.arrays if a.samples is not None]
        if not rates or any(r is None or r <= 0 for r in rates):
            return None
        return 1.0 / sum(1.0 / r for r in rates)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["flags"]
        out["samples"] = self.samples
        out["decode_samples_per_second"] = self.decode_samples_per_second
        out["chunks_missing"] = sum(a.chunks_missing or 0 for a in self.arrays)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def format(self) -> str:
        lines = [
            f"{self.path}: zarr format {self.zarr_format}, {len(self.arrays)} array(s), "
            + (
                f"{self.samples:,} samples along {_dim_label(self.sample_dim)}"
                if self.samples is not None
                else f"arrays disagree on the number of samples along {_dim_label(self.sample_dim)}"
            ),
        ]
        header = ("array", "shape", "dtype", "chunks", "codecs", "on disk", "in memory")
        header += ("compression", "missing chunks", "decode")
        rows = [header]
        for a in self.arrays:
            chunks = _tuple(a.chunks) + (f" in shards {_tuple(a.shards)}" if a.shards else "")
            ratio = a.bytes_in_memory / a.bytes_stored if a.bytes_stored else math.nan
            missing = "?" if a.chunks_missing is None else f"{a.chunks_missing}/{a.chunks_total}"
            rate = a.decode_samples_per_second
            rows.append(
                (
                    a.name,
                    _tuple(a.shape),
                    a.dtype,
                    chunks,
                    ", ".join(a.codecs) or "none",
                    _bytes(a.bytes_stored),
                    _bytes(a.bytes_in_memory),
                    f"{ratio:.2f}x",
                    missing,
                    "-" if rate is None else f"{rate:,.0f} samples/s",
                )
            )
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
        for row in rows:
            cells = (str(v).ljust(w) for v, w in zip(row, widths, strict=True))
            lines.append(("  " + "  ".join(cells)).rstrip())
        missing = sum(a.chunks_missing or 0 for a in self.arrays)
        if missing:
            examples = [k for a in self.arrays for k in a.missing_examples][:3]
            lines.append(
                f"WARNING: {missing} chunk(s) are missing (e.g. {examples}): zarr reads them as "
                "the fill value and ZarrSource refuses them; re-write the store"
            )
        bare = [a.name for a in self.arrays if a.checksum is None]
        if bare:
            lines.append(
                f"note: {bare} carry no checksums: a chunk corrupted on disk that still decodes "
                "would be trained on; check every chunk with `dataflow info --verify`, or "
                f"copy the store with checksums: `dataflow convert {self.path} NEW.zarr"
                f"{self.flags}`"
            )
        for a in self.arrays:
            if a.whole_numbers is not None:
                dtype, low, high = a.whole_numbers
                lines.append(
                    f"note: {a.name} ({a.dtype}) held only whole numbers, {low:g} to {high:g}, "
                    f"in the chunks read: as {dtype} it takes "
                    f"{np.dtype(dtype).itemsize / np.dtype(a.dtype).itemsize:.0%} of the bytes "
                    f"to read and decode: `dataflow convert {self.path} NEW.zarr --dtype "
                    f"{a.name}={dtype}{self.flags}` (every value checked as it is copied)"
                )
        rate = self.decode_samples_per_second
        if rate is not None:
            lines.append(
                f"decode estimate: {rate:,.0f} samples/s in one process on this machine (every "
                "array's row of a sample; timed on a few whole chunks)"
            )
        return "\n".join(lines)


def _dim_label(sample_dim: str | int) -> str:
    return f"dimension {sample_dim!r}" if isinstance(sample_dim, str) else f"axis {sample_dim}"


def _tuple(values: Any) -> str:
    return str(tuple(int(v) for v in values))


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # unreachable


def _codec(codec: Any) -> str:
    """``zstd(level=3)``: a codec's name and settings, for zarr v3 codecs and numcodecs."""
    if hasattr(codec, "to_dict"):
        spec = codec.to_dict()
        name, config = spec.get("name", type(codec).__name__), spec.get("configuration", {})
    elif hasattr(codec, "get_config"):
        config = dict(codec.get_config())
        name = config.pop("id", type(codec).__name__)
    else:
        return type(codec).__name__
    keep = {k: v for k, v in config.items() if k in ("level", "clevel", "cname", "shuffle")}
    return name + ("(" + ", ".join(f"{k}={v}" for k, v in keep.items()) + ")" if keep else "")


def _arrays(node: Any) -> list[tuple[str, zarr.Array]]:
    """Every array of a group (nested ones as ``group/name``), or the array itself."""
    if isinstance(node, zarr.Array):
        return [(node.basename or "<array>", node)]
    members = node.members(max_depth=None)
    return sorted((str(n), m) for n, m in members if isinstance(m, zarr.Array))


def _sample_axis(array: zarr.Array, sample_dim: str | int) -> int | None:
    """The array's axis along ``sample_dim`` (None: it has none). By axis number, an
    xarray coordinate (1-D, named as its dimension: ``lat``, ``time``) has no samples."""
    if not array.shape:
        return None
    names = getattr(array.metadata, "dimension_names", None)
    if names is None:
        names = array.attrs.get("_ARRAY_DIMENSIONS")
    if isinstance(sample_dim, str):
        return list(names).index(sample_dim) if names and sample_dim in names else None
    if names is not None and list(names) == [array.basename]:
        return None
    return sample_dim if -len(array.shape) <= sample_dim < len(array.shape) else None


def _decode_rate(
    array: zarr.Array, axis: int, unit: int, present: list[int], budget_s: float
) -> tuple[float | None, tuple[str, float, float] | None]:
    """Samples/s reading whole chunks (every chunk across the other dimensions) of
    ``present`` chunk indices along ``axis``: a warm-up read, then up to 8 spread over the
    array until ``budget_s`` is spent; and, for a float array whose chunks read held only
    whole numbers, the integer dtype that holds them and their range."""
    if not present:
        return None, None
    picks = [present[int(i)] for i in np.unique(np.linspace(0, len(present) - 1, 8).round())]
    floats = np.dtype(array.dtype).kind == "f"
    low, high, whole = math.inf, -math.inf, floats

    def read(chunk: int) -> tuple[int, float]:
        nonlocal low, high, whole
        region: list[Any] = [slice(None)] * len(array.shape)
        stop = min((chunk + 1) * unit, array.shape[axis])
        region[axis] = slice(chunk * unit, stop)
        started = time.perf_counter()
        values = np.asarray(array[tuple(region)])
        seconds = time.perf_counter() - started
        if whole and values.size:  # (outside the timed read)
            whole = not not_whole(values).any()
            low, high = min(low, float(values.min())), max(high, float(values.max()))
        return stop - chunk * unit, seconds

    read(picks[0])  # codec set-up, first file open
    samples, seconds = 0, 0.0
    for chunk in picks:
        n, took = read(chunk)
        samples, seconds = samples + n, seconds + took
        if seconds > budget_s:
            break
    rate = samples / seconds if seconds > 0 else None
    narrower = narrower_integer(array.dtype, low, high) if whole and low <= high else None
    return rate, None if narrower is None else (str(narrower), low, high)


def store_info(
    path: str | Path,
    *,
    sample_dim: str | int = 0,
    check_missing: bool = True,
    decode_budget_s: float = 0.5,
    storage_options: dict[str, Any] | None = None,
) -> StoreInfo:
    """Describe the zarr store (group or array) at ``path``; see the module docstring.

    ``sample_dim``: the dimension that indexes samples, a name (stores written from
    xarray) or an axis number; arrays without it are listed with no sample count.
    ``decode_budget_s``: the time spent decoding per array (0: no estimate).
    ``storage_options``: fsspec's, for a URL (as ``ZarrSource`` takes them).
    """
    if isinstance(sample_dim, str) and sample_dim.lstrip("-").isdigit():
        sample_dim = int(sample_dim)
    if not Path(path).exists() and "://" not in str(path):
        raise DataError(f"info: no zarr store at {str(path)!r}; check the path")
    node = open_zarr("info", path, storage_options, "; write one with `dataflow convert`")
    arrays = _arrays(node)
    if not arrays:
        raise DataError(f"info: the zarr store {str(path)!r} holds no arrays")
    described = []
    for name, array in arrays:
        axis = _sample_axis(array, sample_dim)
        unit_shape = array.shards or array.chunks
        grid = [math.ceil(s / c) for s, c in zip(array.shape, unit_shape, strict=True)]
        total = math.prod(grid)
        missing: int | None = None
        examples: list[str] = []
        present: list[int] = []
        if array.shape:
            reader_axis = axis if axis is not None else 0
            reader = ZarrArrayReader(name, array, reader_axis)
            chunks = list(range(grid[reader_axis]))
            if check_missing:
                absent = reader.missing(chunks)
                missing, examples = len(absent), absent[:3]
                bad = {_chunk_of(key, array, reader_axis) for key in absent}
                present = [c for c in chunks if c not in bad]
            else:
                present = chunks
        rate = whole = None
        if axis is not None and decode_budget_s > 0:
            rate, whole = _decode_rate(array, axis, unit_shape[axis], present, decode_budget_s)
        described.append(
            ArrayInfo(
                name=name,
                shape=tuple(int(s) for s in array.shape),
                dtype=str(array.dtype),
                chunks=tuple(int(c) for c in array.chunks),
                shards=None if array.shards is None else tuple(int(s) for s in array.shards),
                codecs=[_codec(c) for c in (*array.filters, *array.compressors)],
                dimension_names=_names(array),
                bytes_stored=int(array.nbytes_stored()),
                bytes_in_memory=int(array.nbytes),
                samples=None if axis is None else int(array.shape[axis]),
                chunks_total=total,
                chunks_missing=missing,
                missing_examples=examples,
                decode_samples_per_second=rate,
                checksum=checksum_of(array),
                whole_numbers=whole,
            )
        )
    if all(a.samples is None for a in described):
        dims = sorted({d for a in described for d in (a.dimension_names or [])})
        raise ConfigError(
            f"info(--sample-dim {sample_dim!r}): no array of {str(path)!r} has that dimension; "
            + (f"use one of {dims}" if dims else "give an axis number, e.g. 0")
        )
    return StoreInfo(
        path=str(path),
        zarr_format=int(getattr(next(iter(arrays))[1].metadata, "zarr_format", 3)),
        sample_dim=sample_dim,
        arrays=described,
        flags=storage_flags(storage_options),
    )


def _names(array: zarr.Array) -> list[str] | None:
    names = getattr(array.metadata, "dimension_names", None)
    if names is None:
        names = array.attrs.get("_ARRAY_DIMENSIONS")
    return None if names is None else [str(n) for n in names]


def _chunk_of(key: str, array: zarr.Array, axis: int) -> int:
    """The chunk index along ``axis`` of a chunk key (``c/3/0/0``, ``3.0.0`` or ``3/0/0``)."""
    tail = key[len(array.path) + 1 :] if array.path and key.startswith(array.path) else key
    parts = [p for p in tail.replace(".", "/").split("/") if p.isdigit()]
    return int(parts[axis]) if len(parts) > axis else -1
