"""A store given by its path whose arrays are CF-encoded is read as the data they encode.

xarray writes netCDF's packing and masking into a zarr store as attributes: int16
values with ``scale_factor`` and ``add_offset`` (ERA5's packing), a ``_FillValue`` or
``missing_value`` of -32767 or 1e20 where nothing was measured, ``_Unsigned`` bytes
kept as signed. Read as stored, those are not the data: the model would train on
packed integers and on the fill value as if it were a measurement, and nothing would
say so. So a source given a path or URL opens such a store through xarray (lazily,
metadata only) and reads it as it reads a Dataset: raw from the stored chunks, each
slab decoded by xarray's own functions (``io.xarray_slices``), the values xarray gives
bit for bit. A store without such attributes (``dfl.io.to_zarr``'s, or xarray's floats
whose fill value is NaN) is read from its path as before. An opened ``zarr.Group`` is
zarr's view and is read as stored: pass one to train on the stored integers.
"""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from dataflow.core.errors import ConfigError
from dataflow.io.xarray_backing import raw_zarr

__all__ = ["cf_decoded", "cf_encoding"]

PACKING = ("scale_factor", "add_offset", "_Unsigned")
FILLS = ("_FillValue", "missing_value")


def _fill(value: Any, dtype: np.dtype) -> Any:
    """A fill value attribute as a number (zarr v3 keeps a float's as base64 bytes)."""
    if isinstance(value, str) and dtype.kind in "fc":
        try:
            return np.frombuffer(base64.b64decode(value), dtype=dtype)[0]
        except (ValueError, TypeError):
            return value
    return value


def cf_encoding(attrs: Any, dtype: Any) -> list[str]:
    """The attributes among ``attrs`` that make xarray's values differ from the stored
    ones: packing, ``_Unsigned``, and a fill value that is not NaN (a float NaN fill
    reads as NaN either way)."""
    dtype = np.dtype(dtype)
    found = [key for key in PACKING if key in attrs]
    for key in FILLS:
        if key not in attrs:
            continue
        values = np.atleast_1d(attrs[key]).tolist()
        numbers = [_fill(v, dtype) for v in values]
        nan = [isinstance(v, float | np.floating) and math.isnan(v) for v in numbers]
        if not (dtype.kind in "fc" and all(nan)):
            found.append(key)
    return found


def cf_decoded(store: Any, names: list[str], storage_options: Any, caller: str) -> Any:
    """``store`` as the sources should read it: a path or URL whose arrays ``names`` are
    CF-encoded becomes the split xarray reads of it (raw, decoded slab by slab); anything
    else is returned as it is (a store that does not open is left to the source, whose
    messages say why)."""
    if not isinstance(store, (str, Path)) or not names:
        return store
    options = dict(storage_options) if storage_options else None
    try:
        opened = {} if options is None else {"storage_options": options}
        group = zarr.open_group(store=str(store), mode="r", **opened)
        arrays = {name: group[name] for name in names if name in group.array_keys()}
    except Exception:
        return store
    encoded = {
        name: keys
        for name, array in arrays.items()
        if (keys := cf_encoding(array.attrs, array.dtype))
    }
    if not encoded:
        return store
    described = "; ".join(f"{name}: {', '.join(keys)}" for name, keys in encoded.items())
    try:
        import xarray
    except ImportError:
        raise ConfigError(
            f"{caller}({str(store)!r}): the stored values of {described} are CF-encoded "
            "(packed or masked: not the data as measured), which dataflow decodes as xarray "
            "does; install xarray (pip install xarray), or pass zarr.open_group(path) to "
            "train on the stored values as they are"
        ) from None
    consolidated = getattr(group.metadata, "consolidated_metadata", None) is not None
    dataset = xarray.open_dataset(
        str(store),
        engine="zarr",
        chunks=None,
        consolidated=consolidated,
        storage_options=options,
    )
    return raw_zarr(dataset, [n for n in names if n in dataset.variables])
