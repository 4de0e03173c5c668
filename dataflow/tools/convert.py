"""``dataflow convert``: numpy, HDF5 and netCDF files into a zarr store laid out for streaming
(and a zarr store into one with new chunks: ``tools.rechunk``).

Every input becomes arrays with a sample axis, written by ``dataflow.io.to_zarr``
(whole samples per chunk, ~``chunk_mb`` MB a chunk). Large inputs are never
loaded whole: ``.npy`` is memory-mapped, HDF5 and netCDF are read lazily through
dask a slab at a time. Every mistake a user can make on the command line (a
wrong path, variable, dimension, or a missing reader package) is a
``DataflowError`` that names it and says the fix.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError, DataError
from dataflow.history.report import MissingDependencyError
from dataflow.io import VariableNotFoundError, to_zarr
from dataflow.io.checksums import check_compressor
from dataflow.io.store_open import local_path_error
from dataflow.tools.rechunk import (
    Rechunked,
    SourceFileError,
    check_dest,
    is_zarr_source,
    local_dest,
    rechunk_store,
)

FORMATS = {
    ".npy": "numpy",
    ".npz": "numpy",
    ".nc": "netcdf",
    ".nc4": "netcdf",
    ".netcdf": "netcdf",
    ".cdf": "netcdf",
    ".h5": "hdf5",
    ".hdf5": "hdf5",
    ".hdf": "hdf5",
    ".he5": "hdf5",
}
SAMPLE = "sample"  # the sample dimension's name for inputs without named dimensions


@dataclass(frozen=True)
class Converted:
    """What ``convert`` wrote: the store, its arrays' shapes, and how to read it back."""

    dest: Path
    shapes: dict[str, tuple[int, ...]]
    x: tuple[str, ...]
    y: str | None
    sample_dim: str | None  # None: the first axis (the store has no dimension names)
    left_out: tuple[str, ...] = ()  # variables of the file not named with --x/--y

    def snippet(self) -> str:
        x = repr(self.x[0]) if len(self.x) == 1 else repr(list(self.x))
        args = [repr(str(self.dest)), f"x={x}"]
        if self.y is not None:
            args.append(f"y={self.y!r}")
        if self.sample_dim is not None:
            args.append(f"sample_dim={self.sample_dim!r}")
        return f"dataflow.io.ZarrSource({', '.join(args)})"


def convert(
    src: str | Path,
    dest: str | Path,
    *,
    x: list[str] | None = None,
    y: str | None = None,
    sample_dim: str | int | None = None,
    chunk_mb: float | None = None,
    zarr_format: int | None = None,
    overwrite: bool = False,
    spatial_chunks: dict[int | str, int] | None = None,
    chunks: str | dict[str | int, int] | None = None,
    fill_missing: bool = False,
    storage_options: dict[str, Any] | None = None,
    compressor: str | None = "zstd",
    dtypes: str | dict[str, Any] | None = None,
) -> Converted | Rechunked:
    """Convert ``src`` (``.npy``, ``.npz``, HDF5 or netCDF) into the zarr store ``dest``,
    or rewrite the zarr store ``src`` (path or fsspec URL) with new ``chunks``.

    ``x``: the input variables (default: ``x`` if the file has one, else its only
    array, else every variable with the sample dimension); ``y``: the target
    variable (default: ``y`` if present). Without ``x``, a file holding variables
    beyond the default x and y is refused (``ConfigError`` listing them), never
    converted in part; ``Converted.left_out`` names what an explicit choice left out.
    ``sample_dim``: the dimension that indexes samples, a name (netCDF) or an axis
    number (numpy, HDF5; default 0).
    ``spatial_chunks``: also chunk each sample for spatial ranks (``to_zarr``'s
    argument): ``{axis of one x sample: length}``, or ``{dimension name: length}``
    for netCDF. ``chunk_mb``: about 8 MB a chunk by default; ``zarr_format``: 3 by default.
    ``compressor``: ``to_zarr``'s, for both kinds of ``src`` ("zstd" by default; "lz4"
    decodes ~2.5x faster, for a GPU fit that reads GB/s).

    A zarr ``src`` is copied by ``rechunk_store`` (every array, or those named by
    ``x``/``y``, with attributes and dimension names, streamed slab by slab, with
    checksums): ``chunks`` is ``{dimension name or axis: length}`` or ``"lat=64,lon=64"``
    (None: same chunks); ``zarr_format`` defaults to the source's; a chunk absent from
    ``src`` raises ``ChunkMissingError`` unless ``fill_missing``; ``storage_options``:
    fsspec's, for a URL ``src`` (as ``ZarrSource`` takes them; ``dest`` is a local path).
    ``dtypes`` (a zarr ``src``): arrays stored narrower, e.g. ``"x=int16"`` for counts held
    as floats, every value checked (``tools.narrowing``).
    """
    check_compressor("convert", compressor)
    if is_zarr_source(src):
        given = {"sample_dim": sample_dim, "chunk_mb": chunk_mb, "spatial_chunks": spatial_chunks}
        for name, value in given.items():
            if value is not None:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"convert({flag}): {str(src)!r} is a zarr store, which convert rechunks "
                    "as it is; give the new chunks with --chunks DIM=LEN,... instead"
                )
        names = [*(x or []), *([y] if y else [])] or None
        return rechunk_store(
            src,
            dest,
            chunks,
            arrays=names,
            zarr_format=zarr_format,
            overwrite=overwrite,
            fill_missing=fill_missing,
            compressor=compressor,
            storage_options=storage_options,
            dtypes=dtypes,
        )
    if storage_options is not None:
        raise ConfigError(local_path_error("convert", src))
    if dtypes is not None:
        if not isinstance(dtypes, str):
            dtypes = ",".join(f"{name}={dtype}" for name, dtype in dtypes.items())
        raise ConfigError(
            f"convert(--dtype): stores arrays narrower when it copies a zarr store, and "
            f"{str(src)!r} is a file; convert it first, then the store: dataflow convert "
            f"{src} tmp.zarr && dataflow convert tmp.zarr {dest} --dtype {dtypes}"
        )
    chunk_mb = 8.0 if chunk_mb is None else chunk_mb
    zarr_format = 3 if zarr_format is None else zarr_format
    src, dest = Path(src), local_dest(dest)
    if not src.exists():
        raise SourceFileError(f"convert: no file {str(src)!r}; check the path")
    kind = FORMATS.get(src.suffix.lower())
    if kind is None and src.is_dir():
        raise DataError(
            f"convert: {str(src)!r} is a directory but not a zarr store (no zarr.json, .zgroup "
            "or .zarray in it); give a zarr store, or a numpy, HDF5 or netCDF file"
        )
    if kind is None:
        raise ConfigError(
            f"convert: cannot read {src.name!r}: unknown extension {src.suffix!r}; supported: "
            f"{', '.join(sorted(FORMATS))} (numpy, netCDF, HDF5) and .zarr stores"
        )
    if chunks is not None or fill_missing:
        raise ConfigError(
            f"convert(--chunks/--fill-missing): these rewrite a zarr store, and {str(src)!r} is "
            "not one; for numpy, HDF5 and netCDF files use --chunk-mb and --spatial-chunks"
        )
    if not (isinstance(chunk_mb, int | float) and chunk_mb > 0):
        raise ConfigError(f"convert(chunk_mb={chunk_mb!r}): must be a positive number, e.g. 8")
    if zarr_format not in (2, 3):
        raise ConfigError(f"convert(zarr_format={zarr_format!r}): use 2 or 3")
    check_dest(dest, overwrite)
    if dest.exists():
        shutil.rmtree(dest)
    if isinstance(sample_dim, str) and sample_dim.lstrip("-").isdigit():
        sample_dim = int(sample_dim)
    options: dict[str, Any] = {"chunk_mb": chunk_mb, "compressor": compressor}
    if zarr_format != 3:
        options["zarr_format"] = zarr_format
    if spatial_chunks is not None:
        options["spatial_chunks"] = spatial_chunks
    if kind == "numpy":
        return _convert_numpy(src, dest, x, y, sample_dim, options)
    if kind == "hdf5" and not isinstance(sample_dim, str) and _has("h5py"):
        return _convert_h5py(src, dest, x, y, sample_dim, options)
    return _convert_xarray(src, dest, kind, x, y, sample_dim, options)


def parse_spatial_chunks(pairs: list[str] | None) -> dict[int | str, int] | None:
    """``--spatial-chunks``: ``AXIS=LEN`` (an axis of one sample) or ``DIM=LEN`` (a
    dimension name) pairs."""
    if not pairs:
        return None
    chunks: dict[int | str, int] = {}
    for pair in pairs:
        key, _, length = pair.partition("=")
        if not key or not length.isdigit():
            raise ConfigError(
                f"convert(--spatial-chunks {pair}): give AXIS=LEN, e.g. 1=32 to chunk the first "
                "spatial axis of each sample by 32 (or DIM=LEN with a netCDF dimension name)"
            )
        chunks[int(key) if key.isdigit() else key] = int(length)
    return chunks


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _pick(
    src: Path, available: list[str], x: list[str] | None, y: str | None, default_all: bool
) -> tuple[list[str], str | None]:
    """The x and y variable names, checked against what the file holds."""
    for name in [*(x or []), *([y] if y else [])]:
        if name not in available:
            raise VariableNotFoundError(
                f"convert: {src.name!r} has no variable {name!r}; it holds {available}: pass "
                "one of those with --x/--y"
            )
    if y is None and "y" in available and "y" not in (x or []):
        y = "y"
    if not x:
        rest = [name for name in available if name != y]
        if "x" in rest:
            x = ["x"]
        elif len(rest) == 1 or (default_all and rest):
            x = rest
        else:
            raise ConfigError(
                f"convert: {src.name!r} holds {available}; name the input variable(s) with "
                "--x NAME [NAME ...] (and the target with --y NAME)"
            )
        dropped = [name for name in rest if name not in x]
        if dropped:  # never drop silently what the user did not choose to leave out
            target = f" and {y!r} as the target" if y else ""
            raise ConfigError(
                f"convert: {src.name!r} holds {available}; without --x only {x[0]!r} would be "
                f"written as the input{target}, and {dropped} dropped. Name the inputs with "
                f"--x (e.g. --x {' '.join(rest)}) and the target with --y, or pick only "
                "the ones you want"
            )
    if y is not None and y in x:
        raise ConfigError(f"convert: {y!r} is given both as --x and as --y; pick one")
    return list(x), y


def _axis(src: Path, sample_dim: str | int | None, shape: tuple[int, ...], name: str) -> int:
    if sample_dim is None:
        return 0
    if isinstance(sample_dim, str):
        raise ConfigError(
            f"convert: {src.name!r} has no dimension names, so --sample-dim must be an axis "
            f"number (0 for the first), not {sample_dim!r}"
        )
    if not -len(shape) <= sample_dim < len(shape) or not shape:
        raise ConfigError(
            f"convert(--sample-dim {sample_dim}): out of range for {name!r} of shape {shape}; "
            f"use 0..{max(len(shape) - 1, 0)}"
        )
    return sample_dim % len(shape)


def _convert_numpy(
    src: Path, dest: Path, x: list[str] | None, y: str | None, sample_dim: Any, options: dict
) -> Converted:
    if src.suffix.lower() == ".npy":
        if y is not None or (x and len(x) > 1):
            raise ConfigError(
                f"convert: {src.name!r} is a .npy file, which holds one array; give it one name "
                "with --x NAME, or save inputs and targets together with numpy.savez and "
                "convert the .npz"
            )
        try:
            array = np.load(src, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DataError(f"convert: cannot read {src.name!r} as a numpy array ({exc})") from exc
        arrays, names, target = {(x or ["x"])[0]: array}, x or ["x"], None
        left_out = ()
    else:
        try:
            archive = np.load(src, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DataError(f"convert: cannot read {src.name!r} as a .npz archive ({exc})") from exc
        with archive:
            names, target = _pick(src, list(archive.files), x, y, default_all=False)
            arrays = {name: archive[name] for name in [*names, *([target] if target else [])]}
            left_out = tuple(n for n in archive.files if n not in arrays)
    moved = {}
    for name, array in arrays.items():
        axis = _axis(src, sample_dim, tuple(array.shape), name)
        moved[name] = np.moveaxis(array, axis, 0) if axis else array
    if len(names) == 1:
        to_zarr(
            dest,
            moved[names[0]],
            None if target is None else moved[target],
            x_name=names[0],
            y_name=target or "y",
            **options,
        )
        return Converted(dest, _shapes(moved), tuple(names), target, None, left_out)
    arrays = {k: (v, 0) for k, v in moved.items()}
    to_zarr(dest, _dataset(arrays), sample_dim=SAMPLE, **_named_splits(options, arrays, names))
    return Converted(dest, _shapes(moved), tuple(names), target, SAMPLE, left_out)


def _shapes(arrays: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(s) for s in array.shape) for name, array in arrays.items()}


def _xarray(reason: str) -> Any:
    try:
        import xarray
    except ImportError as exc:
        raise MissingDependencyError(f"convert: {reason} needs xarray: pip install xarray") from exc
    return xarray


def _dataset(arrays: dict[str, tuple[Any, int]]) -> Any:
    """An xarray Dataset of (array, sample axis) pairs; the sample dimension is ``SAMPLE``."""
    xarray = _xarray("converting several input arrays")
    variables = {}
    for name, (array, axis) in arrays.items():
        dims = [f"{name}_dim{i}" for i in range(array.ndim)]
        dims[axis] = SAMPLE
        variables[name] = (dims, array)
    return xarray.Dataset(variables)


def _convert_h5py(
    src: Path, dest: Path, x: list[str] | None, y: str | None, sample_dim: Any, options: dict
) -> Converted:
    import dask.array as da
    import h5py

    with h5py.File(src, "r") as f:
        datasets: dict[str, Any] = {}

        def collect(path: str, item: Any) -> None:
            if isinstance(item, h5py.Dataset) and item.shape:
                datasets[path] = item

        f.visititems(collect)
        names = [n.lstrip("/") for n in x] if x else None
        names, target = _pick(
            src, sorted(datasets), names, y.lstrip("/") if y else None, default_all=False
        )
        chosen = [*names, *([target] if target else [])]
        stored = _flat_names(chosen)
        arrays = {}
        for name in chosen:
            dataset = datasets[name]
            axis = _axis(src, sample_dim, tuple(dataset.shape), name)
            chunks = dataset.chunks or "auto"
            arrays[stored[name]] = (da.from_array(dataset, chunks=chunks, lock=True), axis)
        x_stored = [stored[n] for n in names]
        options = _named_splits(options, arrays, x_stored)
        to_zarr(dest, _dataset(arrays), sample_dim=SAMPLE, **options)
        shapes = _shapes({k: v for k, (v, _) in arrays.items()})
        left_out = tuple(n for n in sorted(datasets) if n not in chosen)
    x_names = tuple(stored[n] for n in names)
    y_name = stored[target] if target else None
    return Converted(dest, shapes, x_names, y_name, SAMPLE, left_out)


def _named_splits(options: dict, arrays: dict[str, tuple[Any, int]], x: list[str]) -> dict:
    """Axis-numbered ``spatial_chunks`` as the dimension names ``_dataset`` gives each x
    variable (``NAME_dimI``), so only the inputs are split."""
    spatial = options.get("spatial_chunks")
    if not spatial or not all(isinstance(k, int) for k in spatial):
        return options  # named: to_zarr checks the names
    named = {}
    for name in x:
        array, axis = arrays[name]
        others = [i for i in range(array.ndim) if i != axis]
        for key, length in spatial.items():
            if not 0 <= key < len(others):
                raise ConfigError(
                    f"convert(spatial_chunks={{{key}: ...}}): {name!r} has {len(others)} axes "
                    f"per sample; use 0..{len(others) - 1} (0 is the channels)"
                )
            named[f"{name}_dim{others[key]}"] = length
    return {**options, "spatial_chunks": named}


def _flat_names(paths: list[str]) -> dict[str, str]:
    """HDF5 paths as top-level zarr array names: the last part ("grp/x" -> "x") when that
    is unique among ``paths``, else the whole path with "/" as "_"."""
    last = [p.rsplit("/", 1)[-1] for p in paths]
    return {
        p: short if last.count(short) == 1 else p.replace("/", "_")
        for p, short in zip(paths, last, strict=True)
    }


def _open_xarray(src: Path, kind: str) -> Any:
    xarray = _xarray(f"reading {kind} files")
    engines = {"hdf5": ["h5netcdf"], "netcdf": [None]}[kind]
    try:
        return xarray.open_dataset(src, chunks={}, engine=engines[0])
    except (ValueError, ImportError, ModuleNotFoundError) as exc:
        text = str(exc)
        if kind == "hdf5":
            raise MissingDependencyError(
                f"convert: reading the HDF5 file {src.name!r} needs h5py: pip install h5py "
                f"(or h5netcdf for netCDF-style files with named dimensions) ({text})"
            ) from exc
        if "engine" in text or "backend" in text or isinstance(exc, ImportError):
            raise MissingDependencyError(
                f"convert: xarray found no reader for {src.name!r}: pip install netCDF4 "
                f"(or h5netcdf for netCDF-4 files, scipy for netCDF-3) ({text})"
            ) from exc
        raise DataError(f"convert: cannot read {src.name!r} as netCDF ({text})") from exc
    except OSError as exc:
        raise DataError(f"convert: cannot read {src.name!r} as {kind} ({exc})") from exc


def _convert_xarray(
    src: Path,
    dest: Path,
    kind: str,
    x: list[str] | None,
    y: str | None,
    sample_dim: Any,
    options: dict,
) -> Converted:
    with _open_xarray(src, kind) as dataset:
        available = sorted(map(str, dataset.data_vars))
        names, target = _pick(src, available, x, y, default_all=True)
        chosen = [*names, *([target] if target else [])]
        dims = sorted({str(d) for name in chosen for d in dataset[name].dims})
        if isinstance(sample_dim, int):
            raise ConfigError(
                f"convert: {src.name!r} names its dimensions ({dims}); give --sample-dim as one "
                f"of those names, not the axis number {sample_dim}"
            )
        if sample_dim is None:
            first = dataset[chosen[0]].dims
            common = [d for d in first if all(d in dataset[n].dims for n in chosen)]
            if len(common) != 1 and not (common and common[0] == first[0]):
                raise ConfigError(
                    f"convert: which dimension of {src.name!r} indexes samples? the variables "
                    f"{chosen} have dimensions {dims}; pass --sample-dim NAME"
                )
            sample_dim = str(common[0])
        if sample_dim not in dataset.dims:
            raise ConfigError(
                f"convert(--sample-dim {sample_dim!r}): {src.name!r} has no such dimension; "
                f"use one of {sorted(map(str, dataset.dims))}"
            )
        if not x:  # every variable by default: those that have the sample dimension
            names = [n for n in names if sample_dim in dataset[n].dims] or names
            chosen = [*names, *([target] if target else [])]
        lacking = [n for n in chosen if sample_dim not in dataset[n].dims]
        if lacking:
            raise ConfigError(
                f"convert: variable(s) {lacking} of {src.name!r} have no dimension "
                f"{sample_dim!r} (they have {[list(dataset[n].dims) for n in lacking]}); "
                "drop them from --x/--y or pick another --sample-dim"
            )
        to_zarr(dest, dataset[chosen], sample_dim=sample_dim, **options)  # (its coordinates)
        shapes = {n: tuple(int(s) for s in dataset[n].shape) for n in chosen}
        left_out = tuple(n for n in available if n not in chosen)
    return Converted(dest, shapes, tuple(names), target, sample_dim, left_out)
