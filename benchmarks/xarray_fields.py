"""The store the xarray benchmarks read: random float32 ``(steps, side, side)`` over
``(time, lat, lon)``, written by xarray (zarr 3, no consolidated metadata)."""

from __future__ import annotations


def write_fields(path: str, steps: int, side: int, chunks: tuple[int, int, int]) -> None:
    """Variable ``t`` at ``path``, chunked ``chunks``, computed chunk by chunk by dask."""
    import dask.array
    import xarray as xr

    field = dask.array.random.default_rng(0).standard_normal((steps, side, side), chunks=chunks)
    dataset = xr.Dataset({"t": (("time", "lat", "lon"), field.astype("float32"))})
    dataset.to_zarr(path, consolidated=False, encoding={"t": {"chunks": chunks}})
