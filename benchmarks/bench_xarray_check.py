"""What checking the zarr arrays behind xarray data costs, against one read of that data.

A source built on xarray data that is not a plain view of its zarr array (here a
slice, ``ds["t"].isel(time=...)``) is read through xarray, which would give a missing
chunk's fill value; so the source lists the array's stored chunks once, when it is
built (``dataflow.io.xarray_backing.check_complete``). The baseline in the same run is
one read of the sliced data through xarray and dask (what one epoch reads at least).

The store: random float32 ``(--steps, --side, --side)`` written by xarray, chunked
``(8, 32, 32)``; the slice: its first half in time.

    python benchmarks/bench_xarray_check.py                  # 8,192 chunks, 256 MiB
    python benchmarks/bench_xarray_check.py --steps 4096     # 32,768 chunks, 1 GiB

Prints the check's and the read's seconds (median of ``--repeats``, interleaved) and
check / read, and appends the run to ``benchmarks/results/xarray_check.json``.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1024, help="time steps (1024)")
    parser.add_argument("--side", type=int, default=256, help="lat and lon (256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()

    import xarray as xr

    from dataflow.io.xarray_backing import check_complete

    chunks = (8, 32, 32)
    with tempfile.TemporaryDirectory(prefix="xarray-check-") as tmp:
        path = f"{tmp}/fields.zarr"
        write_fields(path, args.steps, args.side, chunks)
        sliced = xr.open_zarr(path, consolidated=False)["t"].isel(time=slice(0, args.steps // 2))
        stored = -(-args.steps // 8) * (-(-args.side // 32)) ** 2
        check_s, read_s = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            check_complete(sliced, "bench", "x", "t")
            check_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            sliced.values  # noqa: B018 (the read)
            read_s.append(time.perf_counter() - started)
    check, read = statistics.median(check_s), statistics.median(read_s)
    rows = [
        ("list the stored chunks (the check)", f"{check:.3f}"),
        ("read the slice through xarray (baseline)", f"{read:.3f}"),
        ("check / read", f"{check / read:.3f}"),
    ]
    print(f"{stored:,} stored chunks; the slice reads {args.steps // 2} of {args.steps} steps")
    print(table(rows, ("side", "seconds")))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    run = {
        "label": args.label,
        "config": config,
        "stored_chunks": stored,
        "check_s": check_s,
        "read_s": read_s,
        "check_over_read": check / read,
    }
    print("saved", save_run("xarray_check", run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
