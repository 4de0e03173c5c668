"""``dataflow convert SRC.zarr DEST.zarr --chunks DIM=LEN,...``: a zarr store rewritten
with new chunks (and checksums).

``dataflow info --patch`` says when a store's chunks suit a window size badly; this
writes the copy it suggests. Every array (or those named) is copied with its
attributes and dimension names; a dimension is named by its name (stores written by
xarray) or by axis number, and an array without it keeps its chunks along the others.

Streamed: each array is copied in slabs aligned to the destination's chunks (so every
chunk is written once, whole) and, where the memory budget allows, to the source's
(so every source chunk is decoded once), never the whole array. The source is read by
the engine's own decoder (``io.zarr_decode``): a chunk absent from the source (zarr
would read it as the fill value) is refused naming it, never written out as data, and
a chunk failing its checksum is named too. The copy carries checksums chosen as
``dfl.io.to_zarr`` chooses them (``io.checksums``). It is written beside DEST and moved
there only when complete, so a failed copy leaves no store that looks whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import shutil
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync

from dataflow.core.errors import (
    ChunkMissingError,
    ChunkReadError,
    ConfigError,
    DataError,
    DataflowError,
)
from dataflow.io.checksums import check_compressor, checksummed_codecs
from dataflow.io.read_errors import chunk_read_error
from dataflow.io.store_open import open_zarr
from dataflow.io.zarr_decode import MissingObject, ObjectDecodeError, chunk_decoder
from dataflow.tools.info import _arrays, _names
from dataflow.tools.narrowing import check_castable, fill_value_as, narrowed, parse_dtypes
from dataflow.tools.slabs import slab_shape

DEFAULT_MEMORY_MB = 256.0  # a slab in memory at once (and at least one destination chunk)
MARKERS = ("zarr.json", ".zgroup", ".zarray")  # what makes a directory a zarr store


class SourceFileError(DataflowError, FileNotFoundError):
    """The file or store to convert does not exist."""


@dataclass(frozen=True)
class Rechunked:
    """What ``rechunk_store`` wrote: each array's shape and chunks before and after."""

    dest: Path
    zarr_format: int
    shapes: dict[str, tuple[int, ...]]
    chunks_before: dict[str, tuple[int, ...]]
    chunks_after: dict[str, tuple[int, ...]]
    # arrays stored narrower: (new dtype, the largest relative change of a value)
    narrowed: dict[str, tuple[str, float]] = dataclasses.field(default_factory=dict)

    def summary(self) -> list[str]:
        lines = []
        for name, shape in self.shapes.items():
            line = f"{name} {shape}: chunks {self.chunks_before[name]} -> {self.chunks_after[name]}"
            if name in self.narrowed:
                dtype, change = self.narrowed[name]
                line += f", stored as {dtype} " + (
                    "(every value exact)" if change == 0 else f"(values within {change:.2g})"
                )
            lines.append(line)
        return lines


def is_zarr_source(src: str | Path) -> bool:
    """Whether ``src`` names a zarr store: a URL, a ``.zarr`` path, or a directory with
    zarr metadata."""
    text = str(src)
    path = Path(text)
    if "://" in text or path.suffix.lower() == ".zarr":
        return True
    return path.is_dir() and any((path / marker).exists() for marker in MARKERS)


def check_dest(dest: Path, overwrite: bool) -> None:
    """Refuse an existing ``dest`` unless ``overwrite``, and anything but a zarr store even
    then (so a wrong path never deletes unrelated files)."""
    if not dest.exists():
        return
    if not overwrite:
        raise ConfigError(
            f"convert: {str(dest)!r} already exists; choose another destination, or pass "
            "--overwrite to replace it"
        )
    if not any((dest / marker).exists() for marker in MARKERS):
        raise ConfigError(
            f"convert: {str(dest)!r} exists and is not a zarr store; --overwrite replaces "
            "only zarr stores, so choose another destination"
        )


def parse_chunks(chunks: str | Mapping[Any, Any]) -> dict[str | int, int]:
    """``"lat=64,lon=64"`` (dimension names) or ``"1=64,2=64"`` (axes), or such a dict,
    checked: every length an int >= 1."""
    how = (
        "give DIM=LEN pairs separated by commas, LEN an integer >= 1, e.g. --chunks "
        "lat=64,lon=64 (dimension names) or --chunks 1=64,2=64 (axis numbers)"
    )
    if isinstance(chunks, str):
        pairs = [part.partition("=") for part in chunks.replace(" ", "").split(",")]
        if not all(key and length.isdigit() for key, _, length in pairs):
            raise ConfigError(f"convert(--chunks {chunks}): {how}")
        items = [(key, int(length)) for key, _, length in pairs]
    elif isinstance(chunks, Mapping):
        items = list(chunks.items())
    else:
        raise ConfigError(f"convert(chunks={chunks!r}): {how}")
    parsed: dict[str | int, int] = {}
    for key, length in items:
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if (
            isinstance(key, bool)
            or not isinstance(key, (str, int))
            or (isinstance(key, int) and key < 0)
        ):
            raise ConfigError(f"convert(--chunks {key!r}={length!r}): {how}")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(f"convert(--chunks {key}={length!r}): {how}")
        parsed[key] = length
    if not parsed:
        raise ConfigError(f"convert(--chunks {chunks!r}): {how}")
    return parsed


def rechunk_store(
    src: str | Path,
    dest: str | Path,
    chunks: str | Mapping[Any, int] | None = None,
    *,
    arrays: Sequence[str] | None = None,
    zarr_format: int | None = None,
    overwrite: bool = False,
    fill_missing: bool = False,
    compressor: str | None = "zstd",
    memory_mb: float = DEFAULT_MEMORY_MB,
    storage_options: Mapping[str, Any] | None = None,
    dtypes: str | Mapping[str, Any] | None = None,
) -> Rechunked:
    """Copy the zarr store ``src`` (path or fsspec URL) to the local path ``dest``, with
    ``chunks`` (``{dimension name or axis: length}``; None keeps the chunks: a copy with
    checksums). ``arrays``: only these (default: every array). ``zarr_format``: the
    source's by default. ``fill_missing``: write chunks absent from ``src`` as its fill
    value (only for a store whose writer skipped fill-value chunks on purpose); else
    such a chunk raises ``ChunkMissingError``. ``memory_mb``: the slab copied at once.
    ``storage_options``: fsspec's, for a URL ``src`` (as ``ZarrSource`` takes them).
    ``dtypes``: arrays stored narrower, ``{"x": "int16"}`` or ``"x=int16"``, each value
    checked (``tools.narrowing``)."""
    wanted = {} if chunks is None else parse_chunks(chunks)
    narrow = parse_dtypes(dtypes)
    if zarr_format not in (None, 2, 3):
        raise ConfigError(f"convert(zarr_format={zarr_format!r}): use 2 or 3")
    if not (isinstance(memory_mb, int | float) and memory_mb > 0):
        raise ConfigError(f"convert(memory_mb={memory_mb!r}): a positive number, e.g. 256")
    check_compressor("rechunk_store", compressor)
    dest = local_dest(dest)
    node = _open_source(src, storage_options)
    if "://" not in str(src) and _same_or_inside(Path(src), dest):
        raise ConfigError(
            f"convert: DEST {str(dest)!r} is SRC {str(src)!r} or inside it; write the "
            "rechunked copy to a new path (then move it over SRC if you want)"
        )
    check_dest(dest, overwrite)
    chosen = _choose(src, _arrays(node), arrays)
    unknown = sorted(set(narrow) - {name for name, _ in chosen})
    if unknown:
        raise ConfigError(
            f"convert(--dtype {unknown[0]}=...): no array {unknown[0]!r} among those copied "
            f"from {str(src)!r}: {[name for name, _ in chosen]}"
        )
    for name, array in chosen:
        if name in narrow:
            check_castable(name, np.dtype(array.dtype), narrow[name])
    changes: dict[str, float] = {}
    new = {name: _new_chunks(array, wanted) for name, array in chosen}
    _check_known(src, chosen, wanted)
    fmt = zarr_format or node.metadata.zarr_format
    partial = dest.with_name(f".{dest.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)  # a copy that died before it was moved into place
    try:
        if isinstance(node, zarr.Array):
            root = None
        else:
            root = zarr.open_group(str(partial), mode="w", zarr_format=fmt)
            root.attrs.update(node.attrs.asdict())
        budget = int(memory_mb * 2**20)
        for name, array in chosen:
            dtype = narrow.get(name)
            target = _create(root, partial, node, name, array, new[name], fmt, compressor, dtype)
            changes[name] = _copy(src, name, array, target, budget, fill_missing, dtype)
        if node.metadata.zarr_format == fmt and _consolidated(node):
            with warnings.catch_warnings():  # v3's is not in the spec: as the source has it
                warnings.filterwarnings("ignore", "Consolidated metadata", UserWarning)
                zarr.consolidate_metadata(str(partial), zarr_format=fmt)
        if dest.exists():
            shutil.rmtree(dest)
        partial.rename(dest)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return Rechunked(
        dest=dest,
        zarr_format=fmt,
        shapes={name: tuple(int(s) for s in a.shape) for name, a in chosen},
        chunks_before={name: tuple(int(c) for c in a.chunks) for name, a in chosen},
        chunks_after=new,
        narrowed={name: (str(dtype), changes[name]) for name, dtype in narrow.items()},
    )


def local_dest(dest: str | Path) -> Path:
    """``dest`` as a local path: the copy is written beside it and moved into place, which
    an object store cannot do, so a URL is refused, saying how to get the copy there."""
    if "://" in str(dest):
        raise ConfigError(
            f"convert: DEST {str(dest)!r} is a URL; write to a local path (or a mounted "
            "file system), then upload the store (e.g. `aws s3 sync` or `rclone copy`)"
        )
    return Path(dest)


def _open_source(src: str | Path, storage_options: Mapping[str, Any] | None) -> Any:
    text = str(src)
    path = Path(text)
    if "://" not in text and not path.exists():
        raise SourceFileError(f"convert: no zarr store {text!r}; check the path")
    if "://" not in text and not any((path / marker).exists() for marker in MARKERS):
        raise DataError(
            f"convert: {text!r} is not a zarr store (no zarr.json, .zgroup or .zarray in it); "
            "give a zarr store, or a .npy, .npz, HDF5 or netCDF file"
        )
    try:
        return open_zarr("convert", text, storage_options, "; check the path or URL")
    except OSError as exc:  # a local file system's
        raise DataError(f"convert: cannot open {text!r} ({exc}); check the path") from exc


def _same_or_inside(src: Path, dest: Path) -> bool:
    src, dest = src.resolve(), dest.resolve()
    return dest == src or src in dest.parents


def _choose(
    src: str | Path, available: list[tuple[str, zarr.Array]], names: Sequence[str] | None
) -> list[tuple[str, zarr.Array]]:
    """The arrays to copy: every one, or ``names`` (each checked)."""
    if not available:
        raise DataError(f"convert: the zarr store {str(src)!r} holds no arrays")
    if not names:
        return available
    known = dict(available)
    unknown = [name for name in names if name not in known]
    if unknown:
        from dataflow.io import VariableNotFoundError

        raise VariableNotFoundError(
            f"convert: {str(src)!r} has no array {unknown[0]!r}; it holds {sorted(known)}: "
            "name those with --x/--y, or leave both out to copy every array"
        )
    return [(name, known[name]) for name in dict.fromkeys(names)]


def _axis(array: zarr.Array, key: str | int) -> int | None:
    if isinstance(key, int):
        return key if key < len(array.shape) else None
    names = _names(array) or []
    return names.index(key) if key in names else None


def _new_chunks(array: zarr.Array, wanted: Mapping[str | int, int]) -> tuple[int, ...]:
    """The source's chunks, with ``wanted`` along the dims it has (clipped to its length)."""
    chunks = [int(c) for c in array.chunks]
    for key, length in wanted.items():
        axis = _axis(array, key)
        if axis is not None and array.shape[axis] > 0:
            chunks[axis] = min(length, int(array.shape[axis]))
    return tuple(chunks)


def _check_known(
    src: str | Path, chosen: list[tuple[str, zarr.Array]], wanted: Mapping[str | int, int]
) -> None:
    """A dimension no array has is a typo: refuse it, saying what the store has."""
    for key in wanted:
        if any(_axis(array, key) is not None for _, array in chosen):
            continue
        names = sorted({d for _, a in chosen for d in (_names(a) or [])})
        most = max(len(a.shape) for _, a in chosen)
        if isinstance(key, int):
            raise ConfigError(
                f"convert(--chunks {key}=...): no array of {str(src)!r} has axis {key}; its "
                f"arrays have at most {most} axes (0..{most - 1})"
            )
        raise ConfigError(
            f"convert(--chunks {key}=...): no array of {str(src)!r} has a dimension "
            f"{key!r}; "
            + (
                f"its dimension names are {names}"
                if names
                else f"it has no dimension names: give axis numbers, e.g. --chunks 0={wanted[key]}"
            )
        )


def _consolidated(node: Any) -> bool:
    return getattr(node.metadata, "consolidated_metadata", None) is not None


def _create(
    root: zarr.Group | None,
    partial: Path,
    node: Any,
    name: str,
    array: zarr.Array,
    chunks: tuple[int, ...],
    fmt: int,
    compressor: str | None,
    narrow: np.dtype | None = None,
) -> zarr.Array:
    """The destination array: the source's shape, dtype (or ``narrow``), fill value,
    attributes and dimension names, ``chunks``, checksummed codecs (``io.checksums``),
    every chunk written (an absent chunk then always means incomplete)."""
    dtype = np.dtype(array.dtype) if narrow is None else narrow
    if dtype.byteorder not in ("=", "|"):
        dtype = dtype.newbyteorder("=")
    names = _names(array)
    attributes = {k: v for k, v in array.attrs.asdict().items() if k != "_ARRAY_DIMENSIONS"}
    if fmt == 2 and names:
        attributes["_ARRAY_DIMENSIONS"] = names
    filters, compressors = checksummed_codecs(compressor, fmt, dtype)
    options: dict[str, Any] = dict(
        shape=tuple(int(s) for s in array.shape),
        dtype=dtype,
        chunks=chunks,
        filters=filters,
        compressors=compressors,
        fill_value=_fill_value(array, fmt, narrow),
        attributes=attributes,
        config={"write_empty_chunks": True},
    )
    if fmt == 3:
        options["dimension_names"] = names
    if root is None:
        return zarr.create_array(store=str(partial), zarr_format=fmt, **options)
    parent = root
    for part in name.split("/")[:-1]:
        parent = parent.require_group(part)
        source_group = node[parent.path]
        parent.attrs.update(source_group.attrs.asdict())
    return parent.create_array(name.split("/")[-1], **options)


def _fill_value(array: zarr.Array, fmt: int, narrow: np.dtype | None) -> Any:
    """The source's fill value (as ``narrow``, if given); none in a v2 copy of a v3 array:
    v2 readers (xarray) take it as "missing" and would mask real values equal to it."""
    if fmt == 2 and array.metadata.zarr_format == 3:
        return None
    return array.fill_value if narrow is None else fill_value_as(array.fill_value, narrow)


def _copy(
    src: str | Path,
    name: str,
    array: zarr.Array,
    target: zarr.Array,
    budget: int,
    fill_missing: bool,
    narrow: np.dtype | None = None,
) -> float:
    """``array`` into ``target`` slab by slab (``slab_shape``), each slab checked and cast
    to ``narrow`` if given; returns the largest relative change of a value."""
    shape = tuple(int(s) for s in array.shape)
    change = 0.0
    if not shape:
        _check_objects(src, name, array, [()], fill_missing)
        value = np.asarray(array[...])
        target[...] = value if narrow is None else narrowed(name, value, narrow, ())[0]
        return change
    if 0 in shape:
        return change
    src_unit = tuple(int(c) for c in (array.shards or array.chunks))
    unit = slab_shape(shape, src_unit, target.chunks, np.dtype(array.dtype).itemsize, budget)
    numeric = np.dtype(array.dtype).kind in "biufc"
    decoder = chunk_decoder(array) if numeric and not fill_missing else None
    starts = [range(0, s, u) for s, u in zip(shape, unit, strict=True)]
    for corner in itertools.product(*starts):
        box = tuple(slice(lo, min(lo + u, s)) for lo, u, s in zip(corner, unit, shape, strict=True))
        values = _read(src, name, array, decoder, box, src_unit, fill_missing)
        if narrow is not None:
            values, moved = narrowed(name, values, narrow, corner)
            change = max(change, moved)
        target[box] = values
    return change


def _read(
    src: str | Path,
    name: str,
    array: zarr.Array,
    decoder: Any,
    box: tuple[slice, ...],
    unit: tuple[int, ...],
    fill_missing: bool,
) -> np.ndarray:
    """``array[box]``, refusing an absent stored object (zarr would fill it) and naming
    one that fails to decode: by the engine's decoder where it knows the layout, else
    by asking the store for each object, then zarr's read."""
    if decoder is None:
        grid = [range(b.start // c, (b.stop - 1) // c + 1) for b, c in zip(box, unit, strict=True)]
        _check_objects(src, name, array, list(itertools.product(*grid)), fill_missing)
        return np.asarray(array[box])
    out = np.empty(tuple(b.stop - b.start for b in box), np.dtype(array.dtype))
    try:
        return decoder.read(box, out)
    except MissingObject as exc:
        raise _missing(src, name, exc.key) from None
    except ObjectDecodeError as exc:
        error = chunk_read_error(array, name, exc.key, exc.error)
        raise ChunkReadError(str(error).replace("ZarrSource:", "convert:", 1)) from exc.error


def _check_objects(
    src: str | Path,
    name: str,
    array: zarr.Array,
    coords: list[tuple[int, ...]],
    fill_missing: bool,
) -> None:
    if fill_missing:
        return
    store = array.store_path.store
    prefix = f"{array.path}/" if array.path else ""
    keys = [prefix + array.metadata.encode_chunk_key(c) for c in coords]

    async def exists_all() -> list[bool]:
        return await asyncio.gather(*(store.exists(key) for key in keys))

    for key, ok in zip(keys, sync(exists_all()), strict=True):
        if not ok:
            raise _missing(src, name, key)


def _missing(src: str | Path, name: str, key: str) -> ChunkMissingError:
    return ChunkMissingError(
        f"convert: chunk {key!r} of array {name!r} is missing from {str(src)!r}; zarr would "
        "read it as the fill value and the copy would hold that as data, so nothing was "
        "written. Restore the chunk (or re-write the source); if its writer skipped chunks "
        "equal to the fill value on purpose (zarr and xarray do unless written with "
        "write_empty_chunks=True), pass --fill-missing (fill_missing=True) to write them as "
        "the fill value"
    )
