"""``dataflow info STORE --patch lat=64,lon=64``: how a store's chunks suit windows of a
given size (``dataflow.io.PatchSource``), and a chunking that suits them better.

A window read alone decodes every storage chunk it touches. Along a patch dim of
length ``p`` over chunks of ``c``, a window at a random position touches ``1 + (p - 1)
/ c`` chunks on average and at most ``ceil((p - 1) / c) + 1``; along a dim taken whole
it touches them all. With chunks at least the patch along every patch dim, a window
touches at most 2 per dim (``2^d`` in all) and one when it sits on the chunk grid;
chunks much larger than the patch make every window decode far more than it uses, and
chunks below about 1 MB make reads many and small (worst on an object store). So the
suggestion: the patch along patch dims (doubled, shortest first, until a chunk holds
about 1 MB), whole along the others, at most about 16 MB.

Then how a shuffled ``PatchSource`` epoch of the first such array mixes a batch at
``buffer_chunks`` 1, 4 and 16 (``io.mixing``), against C order and a full permutation,
and the memory each buffer holds: the knob that trades mixing for memory.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import zarr

from dataflow.core.errors import ConfigError, DataflowError
from dataflow.io.mixing import Mixing, format_mixing, source_mixing
from dataflow.io.sharding import DEFAULT_BUFFER_CHUNKS
from dataflow.io.store_open import open_zarr
from dataflow.io.windows import bounding_box
from dataflow.tools.info import _arrays, _bytes, _names, _tuple
from dataflow.tools.storage_flags import storage_flags

SMALL_CHUNK = 1_000_000  # bytes: grow suggested chunks to at least this
LARGE_CHUNK = 16_000_000  # bytes: and keep them under this where the patch allows
MIXING_BATCH = 32  # windows per batch in the mixing table
MIXING_MAX_WINDOWS = 2_000_000  # beyond this, the mixing is not measured (seconds, memory)


def parse_patch(text: str) -> dict[str | int, int]:
    """``"lat=64,lon=64"`` (dimension names) or ``"1=64,2=64"`` (axes) as a dict."""
    patch: dict[str | int, int] = {}
    for part in text.replace(" ", "").split(","):
        key, _, length = part.partition("=")
        if not key or not length.isdigit() or int(length) < 1:
            raise ConfigError(
                f"info(--patch {text}): give DIM=LEN pairs separated by commas, e.g. "
                "--patch lat=64,lon=64 (dimension names) or --patch 1=64,2=64 (axes)"
            )
        patch[int(key) if key.isdigit() else key] = int(length)
    return patch


@dataclass
class ArrayAdvice:
    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    window: tuple[int, ...]  # the window over every axis (whole along the others)
    window_bytes: int
    chunk_bytes: int
    chunks_per_window_mean: float  # a window at a random position, read alone
    chunks_per_window_max: int
    bytes_read_per_window: float  # decoded, mean
    suggested_chunks: tuple[int, ...]
    suggested_chunk_bytes: int
    suggested_chunks_per_window_max: int
    suggested_bytes_read_per_window: float
    good: bool  # the chunks already suit the patch
    dimension_names: list[str] | None = None

    @property
    def read_factor(self) -> float:
        """Bytes decoded per byte of window, mean."""
        return self.bytes_read_per_window / max(self.window_bytes, 1)


@dataclass
class MixingAdvice:
    """How a shuffled epoch of windows of ``array`` mixes a batch (``io.mixing``)."""

    array: str
    batch: int
    windows: int
    blocks: int
    super_blocks: int
    block_bytes: float  # a block's decoded box and its cut windows, mean
    precut_bytes: int  # every window written out (a full permutation's copy)
    rows: list[Mixing]

    def format(self) -> str:
        lines = [
            f"shuffled PatchSource(x={self.array!r}) epochs: {self.windows:,} windows (stride "
            f"= patch) in {self.blocks:,} blocks ({_bytes(self.block_bytes)} each, decoded box "
            f"and windows) in {self.super_blocks:,} super-blocks"
        ]
        held = {
            r.order: f"buffer {_bytes(r.buffer_chunks * self.block_bytes)}"
            + (" (the default)" if r.buffer_chunks == DEFAULT_BUFFER_CHUNKS else "")
            for r in self.rows
            if r.buffer_chunks
        }
        held["full permutation"] = f"a pre-cut copy of {_bytes(self.precut_bytes)}"
        lines.extend(format_mixing(self.rows, self.batch, held))
        lines.append(
            "  (Pipeline(buffer_chunks=N), Load(...) or stream_batches(...): more mixes "
            "windows of more blocks into each batch; its buffer holds N blocks per replica)"
        )
        return "\n".join(lines)


@dataclass
class PatchAdvice:
    path: str
    patch: dict[str, int]
    arrays: list[ArrayAdvice]
    skipped: list[str]  # arrays without every patch dim (coordinates, masks of fewer dims)
    rewrite: str | None  # a command that rewrites the store with the suggested chunks
    mixing: MixingAdvice | None = None
    mixing_note: str | None = None  # why the mixing was not measured

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for entry, array in zip(out["arrays"], self.arrays, strict=True):
            entry["read_factor"] = array.read_factor
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def format(self) -> str:
        lines = [
            f"patch {self.patch}: a window read alone touches (mean, max over positions) "
            "chunks and decodes (mean) bytes"
        ]
        header = ("array", "chunks", "chunk", "window", "chunks/window", "read/window", "x window")
        rows = [header]
        for a in self.arrays:
            rows.append(
                (
                    a.name,
                    _tuple(a.chunks),
                    _bytes(a.chunk_bytes),
                    _tuple(a.window),
                    f"{a.chunks_per_window_mean:.1f}, {a.chunks_per_window_max}",
                    _bytes(a.bytes_read_per_window),
                    f"{a.read_factor:.1f}x",
                )
            )
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
        for row in rows:
            cells = (str(v).ljust(w) for v, w in zip(row, widths, strict=True))
            lines.append(("  " + "  ".join(cells)).rstrip())
        if self.skipped:
            lines.append(f"  (not windowed, they lack a patch dim: {self.skipped})")
        changes = [a for a in self.arrays if not a.good]
        for a in self.arrays:
            if a.good:
                lines.append(
                    f"{a.name}: chunks suit this patch (at most {a.chunks_per_window_max} "
                    f"chunk(s) a window, {_bytes(a.chunk_bytes)} a chunk)"
                )
        for a in changes:
            lines.append(
                f"suggested for {a.name}: chunks {_tuple(a.suggested_chunks)} "
                f"({_bytes(a.suggested_chunk_bytes)} a chunk; a window then touches at most "
                f"{a.suggested_chunks_per_window_max}, one when it sits on the chunk grid, and "
                f"decodes {_bytes(a.suggested_bytes_read_per_window)} read alone)"
            )
        if changes or any(a.read_factor > 4 for a in self.arrays):
            lines.append(
                "  (read alone: one window at a time, as a DataLoader reads crops; PatchSource "
                "reads a block of chunks once for all the windows in it, so chunks of about "
                "1-16 MB cost few requests and decode each chunk at most 2^d times an epoch, "
                "however many x window a lone read would decode)"
            )
        if changes and self.rewrite:
            lines.append(f"rewrite the store with them:\n  {self.rewrite}")
        if self.mixing is not None:
            lines.append(self.mixing.format())
        elif self.mixing_note:
            lines.append(f"(mixing not measured: {self.mixing_note})")
        return "\n".join(lines)


def _axes(array: zarr.Array, patch: Mapping[str | int, int]) -> dict[int, int] | None:
    """``{axis: patch length}`` for ``array``, or None when it lacks a patch dim."""
    names = _names(array) or []
    axes = {}
    for key, length in patch.items():
        if isinstance(key, int):
            if not 0 <= key < len(array.shape):
                return None
            axes[key] = length
        elif key in names:
            axes[names.index(key)] = length
        else:
            return None
    return axes


def _touched(p: int, c: int, n: int) -> tuple[float, int]:
    """Chunks of ``c`` along an axis of ``n`` that a run of ``p`` touches: mean, max."""
    grid = math.ceil(n / c)
    return min(1 + (p - 1) / c, grid), min(math.ceil((p - 1) / c) + 1, grid)


def suggest_chunks(shape: tuple[int, ...], axes: Mapping[int, int], itemsize: int) -> list[int]:
    """The patch along patch axes (doubled, shortest first, to about 1 MB; halved, longest
    first, to under about 16 MB), whole along the others."""
    chunks = [min(axes.get(i, n), n) for i, n in enumerate(shape)]

    def size() -> int:
        return math.prod(chunks) * itemsize

    while size() < SMALL_CHUNK:
        growable = [i for i in axes if chunks[i] < shape[i]]
        if not growable:
            break
        i = min(growable, key=lambda a: (chunks[a], a))
        chunks[i] = min(2 * chunks[i], shape[i])
    while size() > LARGE_CHUNK:
        shrinkable = [i for i in axes if chunks[i] > 1]
        if not shrinkable:
            break
        i = max(shrinkable, key=lambda a: (chunks[a], -a))
        chunks[i] = math.ceil(chunks[i] / 2)
    return chunks


def _advise(name: str, array: zarr.Array, axes: Mapping[int, int], itemsize: int) -> ArrayAdvice:
    """Good chunks: whole along the dims taken whole, at least the patch along patch
    dims, under about 16 MB, at least half the suggestion's bytes (or 0.5 MB), and no
    more than twice the bytes a window decodes with the suggestion."""
    shape = tuple(int(s) for s in array.shape)
    chunks = tuple(int(c) for c in array.chunks)
    window = tuple(min(axes.get(i, n), n) for i, n in enumerate(shape))
    mean, most = _per_window(window, chunks, shape)
    own = array.dtype.itemsize
    chunk_bytes = math.prod(chunks) * own
    suggested = tuple(suggest_chunks(shape, axes, itemsize))
    suggested_mean, suggested_max = _per_window(window, suggested, shape)
    suggested_bytes = math.prod(suggested) * own
    window_bytes = math.prod(window) * own
    good = chunks == suggested or (
        all(chunks[i] >= shape[i] for i in range(len(shape)) if i not in axes)
        and all(chunks[i] >= window[i] for i in axes)
        and min(suggested_bytes, SMALL_CHUNK) / 2 <= chunk_bytes <= LARGE_CHUNK
        and mean * chunk_bytes <= 2 * suggested_mean * suggested_bytes
    )
    return ArrayAdvice(
        name=name,
        shape=shape,
        chunks=chunks,
        window=window,
        window_bytes=window_bytes,
        chunk_bytes=chunk_bytes,
        chunks_per_window_mean=mean,
        chunks_per_window_max=most,
        bytes_read_per_window=mean * chunk_bytes,
        suggested_chunks=suggested,
        suggested_chunk_bytes=suggested_bytes,
        suggested_chunks_per_window_max=suggested_max,
        suggested_bytes_read_per_window=suggested_mean * suggested_bytes,
        good=good,
        dimension_names=_names(array),
    )


def _per_window(
    window: tuple[int, ...], chunks: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[float, int]:
    """Chunks a window touches: mean over positions, and at most."""
    mean, most = 1.0, 1
    for p, c, n in zip(window, chunks, shape, strict=True):
        m, x = _touched(p, c, n)
        mean, most = mean * m, most * x
    return mean, most


def _rewrite(path: str, advice: list[ArrayAdvice], flags: str = "") -> str | None:
    """The ``dataflow convert`` command that writes a copy of the store with the suggested
    chunks (``tools.rechunk``: streamed, checksummed, attributes and dimension names kept):
    by dimension name where every array has names, else by axis; per dimension, the
    first array needing a change sets the length (shorter arrays are clipped). ``flags``:
    the store's storage options as flags (``storage_flags``: no credentials)."""
    changes = [a for a in advice if not a.good]
    if not changes:
        return None
    named = all(a.dimension_names for a in advice)
    dims: dict[str | int, int] = {}
    for a in changes:
        keys = a.dimension_names if named else range(len(a.suggested_chunks))
        for key, length in zip(keys or [], a.suggested_chunks, strict=True):
            dims.setdefault(key, length)
    name = path.rstrip("/").rsplit("/", 1)[-1] if "://" in path else path.rstrip("/")
    dest = name.removesuffix(".zarr") + "-rechunked.zarr"
    chunks = ",".join(f"{key}={length}" for key, length in dims.items())
    return (
        f"dataflow convert {shlex.quote(path)} {shlex.quote(dest)} --chunks {shlex.quote(chunks)}"
        + flags
    )


def patch_advice(
    path: str,
    patch: Mapping[str | int, int],
    *,
    storage_options: dict[str, Any] | None = None,
) -> PatchAdvice:
    """How the arrays of the zarr store at ``path`` with every dim of ``patch`` suit
    windows of that size; see the module docstring. ``storage_options``: fsspec's, for
    a URL (as ``ZarrSource`` takes them)."""
    if isinstance(patch, str):
        patch = parse_patch(patch)
    node = open_zarr("info", path, storage_options)
    windowed = [(n, a, _axes(a, patch)) for n, a in _arrays(node)]
    skipped = [n for n, _, axes in windowed if axes is None]
    windowed = [(n, a, axes) for n, a, axes in windowed if axes is not None]
    # one suggestion for arrays of one shape, whatever their dtypes: sized by the smallest
    itemsize = min((a.dtype.itemsize for _, a, _ in windowed), default=1)
    advice = [_advise(n, a, axes, itemsize) for n, a, axes in windowed]
    if not advice:
        dims = sorted({d for _, a in _arrays(node) for d in (_names(a) or [])})
        raise ConfigError(
            f"info(--patch {dict(patch)}): no array of {str(path)!r} has all these dims; "
            + (f"its dimension names are {dims}" if dims else "give axes, e.g. --patch 0=64,1=64")
        )
    mixing, note = _mixing(str(path), node, advice[0], patch, storage_options)
    return PatchAdvice(
        path=str(path),
        patch={str(k): int(v) for k, v in patch.items()},
        arrays=advice,
        skipped=skipped,
        rewrite=_rewrite(str(path), advice, storage_flags(storage_options)),
        mixing=mixing,
        mixing_note=note,
    )


def _mixing(
    path: str,
    node: Any,
    array: ArrayAdvice,
    patch: Mapping[str | int, int],
    storage_options: dict[str, Any] | None,
) -> tuple[MixingAdvice | None, str | None]:
    """The mixing of a shuffled ``PatchSource`` over ``array`` (stride = patch), or why
    it was not measured."""
    from dataflow.io.patch_source import PatchSource

    x = None if isinstance(node, zarr.Array) else array.name
    try:
        source = PatchSource(
            path, x, patch=patch, chunk_cache_mb=0, storage_options=storage_options
        )
    except DataflowError as exc:
        return None, f"PatchSource refused the store: {exc}"
    n = source.num_samples
    if n > MIXING_MAX_WINDOWS:
        return None, f"{n:,} windows, over {MIXING_MAX_WINDOWS:,}"
    if n < 2:
        return None, f"{n} window(s): nothing to mix"
    batch = min(MIXING_BATCH, n)
    members = source.chunk_members
    groups = source.chunk_groups or [0] * len(members)
    g = source.geometry
    itemsize = array.window_bytes // max(1, math.prod(array.window))
    whole = math.prod(n for i, n in enumerate(array.shape) if i not in g.axes)
    boxes = []
    for m in members:
        lo, hi = bounding_box(source.corners[m], g.patch)
        boxes.append(math.prod(int(b - a) for a, b in zip(lo, hi, strict=True)) * whole)
    unit = (sum(boxes) * itemsize + n * array.window_bytes) / len(members)
    return MixingAdvice(
        array=array.name,
        batch=batch,
        windows=n,
        blocks=len(members),
        super_blocks=len(set(groups)),
        block_bytes=unit,
        precut_bytes=n * array.window_bytes,
        rows=source_mixing(source, batch),
    ), None
