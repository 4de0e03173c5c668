"""The store the xarray benchmarks read: random float32 ``(steps, side, side)`` over
``(time, lat, lon)`` (with ``levels``: ``(steps, levels, side, side)`` over ``(time,
level, lat, lon)``), written by xarray (zarr 3, no consolidated metadata)."""

from __future__ import annotations


def write_fields(
    path: str, steps: int, side: int, chunks: tuple[int, ...], levels: int = 0
) -> None:
    """Variable ``t`` at ``path``, chunked ``chunks`` (4 of them with ``levels``),
    computed chunk by chunk by dask."""
    import dask.array
    import xarray as xr

    shape = (steps, levels, side, side) if levels else (steps, side, side)
    dims = ("time", "level", "lat", "lon") if levels else ("time", "lat", "lon")
    field = dask.array.random.default_rng(0).standard_normal(shape, chunks=chunks)
    dataset = xr.Dataset({"t": (dims, field.astype("float32"))})
    dataset.to_zarr(path, consolidated=False, encoding={"t": {"chunks": chunks}})
