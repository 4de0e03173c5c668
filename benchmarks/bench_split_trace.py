"""What a split made in xarray costs to build and to send, at many chunks: the store of
hourly data chunked one step a chunk (as ARCO-ERA5's is), ``--steps`` chunks of one
variable (16 x 16 float32; metadata only: nothing is read), split with
``isel(time=slice(10, -10))``.

For the Dataset opened through dask (``xr.open_zarr``) and lazily (``chunks=None``):
the user's own ``open`` and ``isel`` (the baseline in the same run), then
``ZarrSource(split, x="t", sample_dim="time")`` built (the driver traces the split's
graph, ``io.xarray_slices``), the source pickled (what a worker is sent) and a
worker's copy opened. Prints seconds and bytes, and the build over the user's own
``open`` + ``isel``; appends to ``benchmarks/results/split_trace.json``.

    python benchmarks/bench_split_trace.py                     # 10,000 and 100,000 chunks
    python benchmarks/bench_split_trace.py --steps 300000
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save_run, table  # noqa: E402


def measure(path: str, steps: int, how: str) -> dict[str, float]:
    import xarray as xr

    import dataflow as dfl

    started = time.perf_counter()
    chunks = {} if how == "dask" else None
    ds = xr.open_dataset(path, engine="zarr", chunks=chunks, consolidated=False)
    split = ds.isel(time=slice(10, steps - 10))
    user = time.perf_counter() - started
    started = time.perf_counter()
    source = dfl.io.ZarrSource(split, x="t", sample_dim="time")
    built = time.perf_counter() - started
    started = time.perf_counter()
    blob = pickle.dumps(source)
    pickled = time.perf_counter() - started
    started = time.perf_counter()
    pickle.loads(blob)._open()
    opened = time.perf_counter() - started
    return {
        "open_and_isel_s": user,
        "build_s": built,
        "pickle_s": pickled,
        "pickled_bytes": len(blob),
        "worker_open_s": opened,
        "build_over_user": built / user,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()

    import numpy as np
    import zarr

    found: dict[str, dict[str, dict[str, float]]] = {}
    rows = []
    for steps in args.steps:
        with tempfile.TemporaryDirectory(prefix="split-trace-") as tmp:
            group = zarr.open_group(f"{tmp}/hourly.zarr", mode="w")
            shape, chunks = (steps, 16, 16), (1, 16, 16)
            names = ("time", "lat", "lon")
            group.create_array("t", shape=shape, chunks=chunks, dtype="f4", dimension_names=names)
            time_axis = group.create_array(
                "time", shape=(steps,), chunks=(steps,), dtype="i8", dimension_names=("time",)
            )
            time_axis[:] = np.arange(steps)
            for how in ("dask", "lazy"):
                m = measure(f"{tmp}/hourly.zarr", steps, how)
                found.setdefault(str(steps), {})[how] = m
                rows.append(
                    (
                        f"{steps:,}",
                        how,
                        f"{m['open_and_isel_s']:.2f}",
                        f"{m['build_s']:.2f}",
                        f"{m['pickled_bytes'] / 1e3:,.1f}",
                        f"{m['worker_open_s']:.3f}",
                        f"{m['build_over_user']:.1f}",
                    )
                )
    header = ("chunks", "opened", "open+isel s", "build s", "pickled KB", "worker open s", "x user")
    print(table(rows, header))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    run = {"label": args.label, "config": config, "found": found}
    print("saved", save_run("split_trace", run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
