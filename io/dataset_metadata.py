"""What a Dataset written by ``dfl.io.to_zarr`` (and ``dataflow convert``) keeps besides
its data variables, so that xarray reads the store back as it was: the coordinates
(``time``, ``lat``, ``lon``: a split by label, ``ds.sel(time=slice("1990", "2010"))``,
needs them), encoded as xarray encodes them (times as numbers since an epoch, with
``units`` and ``calendar``), and the variables' and the Dataset's attributes (``units``,
``long_name``, a title). The data variables are written decoded (a CF-packed input is
stored as the values it encodes), so no packing attribute is carried over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import zarr

from dataflow.io.checksums import checksummed_codecs

__all__ = ["json_attrs", "write_metadata"]

PACKING = {"scale_factor", "add_offset", "_FillValue", "missing_value", "_Unsigned"}


def _plain(value: Any) -> Any:
    """A value zarr can keep in its JSON metadata, or None."""
    if isinstance(value, np.generic | np.ndarray):
        value = value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str | bool | int | float) or value is None:
        return value
    if isinstance(value, list | tuple):
        items = [_plain(v) for v in value]
        return None if any(i is None for i in items) else items
    return None


def json_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """``attrs`` as JSON values (numpy scalars and arrays as numbers and lists); packing
    attributes and values JSON cannot hold are left out."""
    kept = {}
    for key, value in attrs.items():
        plain = _plain(value)
        if plain is not None and str(key) not in PACKING:
            kept[str(key)] = plain
    return kept


def write_metadata(
    group: zarr.Group, dataset: Any, arrays: Mapping[str, Any], compressor: str | None
) -> None:
    """Write ``dataset``'s coordinates over the dimensions of ``arrays`` (the data
    variables written: name -> (data, sample axis, dims)) and its attributes into
    ``group``, as xarray writes them; the coordinates compressed with ``compressor`` and
    checksummed, as the data variables are."""
    from xarray.conventions import encode_cf_variable

    dims = {str(d) for _, _, names in arrays.values() for d in names}
    v2 = group.metadata.zarr_format == 2
    written = []
    for name, coordinate in dataset.coords.items():
        name = str(name)
        if name in arrays or not {str(d) for d in coordinate.dims} <= dims:
            continue
        encoded = encode_cf_variable(coordinate.variable, name=name)
        values = np.asarray(encoded.values)
        if values.dtype.kind not in "biuf":  # (strings, objects: not kept)
            continue
        names = [str(d) for d in encoded.dims]
        attrs = json_attrs(encoded.attrs)
        if v2:
            attrs["_ARRAY_DIMENSIONS"] = names
        filters, compressors = checksummed_codecs(
            compressor, group.metadata.zarr_format, values.dtype
        )
        out = group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype,
            chunks=values.shape or None,
            filters=filters,
            compressors=compressors,
            dimension_names=None if v2 else names,
            attributes=attrs,
            **({"fill_value": None} if v2 else {}),
        )
        out[...] = values
        if name not in dataset.dims:
            written.append((name, set(names)))
    for name, (_, _, names) in arrays.items():  # non-dimension coordinates, as xarray says
        here = [c for c, over in written if over <= {str(d) for d in names}]
        if here:
            group[name].attrs["coordinates"] = " ".join(here)
    group.attrs.update(json_attrs(dataset.attrs))
