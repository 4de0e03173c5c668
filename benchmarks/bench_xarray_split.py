"""One epoch of a split made in xarray (``ZarrSource(ds.isel(time=slice(...)), ...)``, or
with ``--source patch`` ``PatchSource``'s windows of it, 4 steps x 64 x 64 each):
read raw (its box of the stored array, ``dataflow.io.xarray_slices``) against the same
split read through xarray and dask (the reader the source used before the box was
traced: the baseline in the same run), and against a store that holds only the split
(the ceiling: what a user who copied the split out would read).

The store: random float32 ``(--steps, --side, --side)`` written by xarray, chunked
``(8, 64, 64)``, opened with ``xarray.open_zarr`` (dask); the split: steps ``--first``
(3: not on a chunk edge, so its first chunk is partial and batches of 32 straddle
chunks, where the copy's line up with them; 8: on an edge) to 3/4 of the way. Each side
reads every sample once, in order, in batches of 32, through the engine's chunk reader
(``decode_threads=1``: one core's rate).

    python benchmarks/bench_xarray_split.py                  # 1,024 steps of 128 x 128
    python benchmarks/bench_xarray_split.py --steps 4096
    python benchmarks/bench_xarray_split.py --steps 4096 --first 8   # on a chunk edge
    python benchmarks/bench_xarray_split.py --source patch           # windows of the split
    python benchmarks/bench_xarray_split.py --levels 4               # and one level of 4
    python benchmarks/bench_xarray_split.py --packed                 # CF-packed int16

Prints each side's samples/s (median of ``--repeats``, interleaved, after one untimed
epoch of each side) and the ratios, and
appends the run to ``benchmarks/results/xarray_split.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save_run, table  # noqa: E402
from xarray_fields import write_fields  # noqa: E402


def epoch_seconds(source, batch: int = 32) -> float:
    """Every sample of ``source`` once, in order, through the chunk reader."""
    import numpy as np

    from dataflow.io.chunk_reader import EpochChunkReader

    n = source.num_samples
    batches = [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
    started = time.perf_counter()
    for _ in EpochChunkReader(source, batches, decode_threads=1):
        pass
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1024, help="time steps (1024)")
    parser.add_argument("--side", type=int, default=128, help="lat and lon (128)")
    parser.add_argument("--first", type=int, default=3, help="the split's first step (3)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--source", choices=("zarr", "patch"), default="zarr", help="ZarrSource or PatchSource"
    )
    parser.add_argument(
        "--packed", action="store_true", help="the store CF-packed int16 (xarray unpacks it)"
    )
    parser.add_argument(
        "--levels",
        type=int,
        default=0,
        help="a level axis of this many (chunked 2 a chunk), the split taking level 1 of it",
    )
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()

    import xarray as xr

    import dataflow as dfl
    from dataflow.io import patch_arrays, xarray_backing, zarr_source

    chunks = (8, 64, 64)
    first, stop = args.first, 3 * args.steps // 4
    with tempfile.TemporaryDirectory(prefix="xarray-split-") as tmp:
        path = f"{tmp}/fields.zarr"
        stored = (8, 2, 64, 64) if args.levels else chunks
        write_fields(path, args.steps, args.side, stored, args.levels, args.packed)
        split = xr.open_zarr(path, consolidated=False).isel(time=slice(first, stop))
        if args.levels:
            split = split.isel(level=1)
        copied = xr.Dataset({"t": split["t"].chunk({"time": 8})})
        copied.to_zarr(f"{tmp}/split.zarr", consolidated=False, encoding={"t": {"chunks": chunks}})

        def source(store):
            if args.source == "patch":
                patch = {"time": 4, "lat": 64, "lon": 64}
                return dfl.io.PatchSource(store, "t", patch=patch, shuffle=False)
            return dfl.io.ZarrSource(store, x="t", sample_dim="time", shuffle=False)

        def raw():
            return source(split)

        def through_xarray():
            # the reader before the box was traced: no box found, where the source is
            # built (xarray_backing) nor where its arrays open (zarr_source, patch_arrays)
            modules = (xarray_backing, zarr_source, patch_arrays)
            traced = [module.zarr_box for module in modules]
            for module in modules:
                module.zarr_box = lambda value: None
            try:
                return source(split)
            finally:
                for module, trace in zip(modules, traced, strict=True):
                    module.zarr_box = trace

        def copy():
            return source(f"{tmp}/split.zarr")

        sides = {"raw box": raw, "through xarray": through_xarray, "store of the split": copy}
        main = max(through_xarray()._open(), key=lambda r: getattr(r, "nbytes", 0))
        assert not getattr(main, "cuts_direct", False) and type(main).__name__ != "ZarrArrayReader"
        for build in sides.values():  # untimed: the first epoch compiles the row copy
            epoch_seconds(build())
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, build in sides.items():
                seconds[name].append(epoch_seconds(build()))
    samples = raw().num_samples
    rate = {name: samples / statistics.median(s) for name, s in seconds.items()}
    rows = [(name, f"{rate[name]:,.0f}") for name in sides]
    rows += [
        ("raw box / through xarray", f"{rate['raw box'] / rate['through xarray']:.2f}"),
        ("raw box / store of the split", f"{rate['raw box'] / rate['store of the split']:.2f}"),
    ]
    what = "windows" if args.source == "patch" else "steps"
    print(
        f"split of {samples} {what} ({stop - first} of {args.steps} steps), {args.side}^2 float32"
    )
    print(table(rows, ("side", "samples/s")))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    run = {
        "label": args.label,
        "config": config,
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": rate,
        "raw_over_xarray": rate["raw box"] / rate["through xarray"],
        "raw_over_copy": rate["raw box"] / rate["store of the split"],
    }
    print("saved", save_run("xarray_split", run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
