"""The store the xarray benchmarks read: random float32 ``(steps, side, side)`` over
``(time, lat, lon)`` (with ``levels``: ``(steps, levels, side, side)`` over ``(time,
level, lat, lon)``), written by xarray (zarr 3, no consolidated metadata)."""

from __future__ import annotations


def write_fields(
    path: str, steps: int, side: int, chunks: tuple[int, ...], levels: int = 0, packed: bool = False
) -> None:
    """Variable ``t`` at ``path``, chunked ``chunks`` (4 of them with ``levels``),
    computed chunk by chunk by dask; ``packed``: stored as CF-packed int16 (``scale_factor``
    and ``add_offset``, as ERA5's netCDF files are), which xarray unpacks to float32."""
    import dask.array
    import xarray as xr

    shape = (steps, levels, side, side) if levels else (steps, side, side)
    dims = ("time", "level", "lat", "lon") if levels else ("time", "lat", "lon")
    field = dask.array.random.default_rng(0).standard_normal(shape, chunks=chunks)
    dataset = xr.Dataset({"t": (dims, field.astype("float32"))})
    encoding = {"chunks": chunks}
    if packed:
        encoding.update(dtype="int16", scale_factor=0.001, add_offset=0.0, _FillValue=-32767)
    dataset.to_zarr(path, consolidated=False, encoding={"t": encoding})
