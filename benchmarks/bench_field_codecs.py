"""How fast the loader reads large fields, by codec and stored dtype.

CosmoFlow-like samples (4 x 128^3, one sample a chunk, batches of 4): smooth particle
counts, stored as float32, int16 and float16 with each ``--codecs`` compressor, read by
the Load stage's reader (``EpochChunkReader``: whole-chunk batches decoded straight into
their buffers, on ``--threads`` decode threads). The baseline, in the same run, is the
default store: float32 with zstd. A GPU that steps through GB/s of samples needs the
reader to keep up; a store of counts as int16 (``Log1p`` on the device) halves the
bytes to decode and copy.

    python benchmarks/bench_field_codecs.py                  # zstd and lz4, 1 and 2 threads
    python benchmarks/bench_field_codecs.py --tiny --out /tmp/f.json   # a smoke run

Prints samples/s and decoded GB/s (best of ``--repeats``) with the ratio to the baseline
at the same thread count, and appends the run to ``benchmarks/results/field_codecs.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save_run, table  # noqa: E402

import dataflow as dfl  # noqa: E402
from dataflow.io.batch_buffers import BatchBuffers  # noqa: E402
from dataflow.io.chunk_reader import EpochChunkReader  # noqa: E402

BASELINE = ("zstd", "float32")  # to_zarr's default codec, the fields as simulated


def counts(samples: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Smooth particle-count fields (0 to a few dozen): Poisson draws of the exponential
    of a normalised random walk, as int16."""
    rng = np.random.default_rng(seed)
    out = np.empty((samples, *shape), np.int16)
    for i in range(samples):
        field = rng.standard_normal(shape).astype(np.float32)
        for axis in range(1, field.ndim):
            field = np.cumsum(field, axis=axis)
        field = (field - field.mean()) / field.std()
        out[i] = rng.poisson(np.exp(field.clip(-3, 3)))
    return out


def read_rate(path: str, batch: int, threads: int, repeats: int) -> float:
    """The best samples/s of ``repeats`` whole reads of the store, in batches of ``batch``."""
    source = dfl.io.ZarrSource(path, x="x", y="y")
    n = source.num_samples
    batches = [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        reader = EpochChunkReader(
            source, batches, buffers=BatchBuffers(keep=6), decode_threads=threads
        )
        for _ in reader:
            pass
        best = max(best, n / (time.perf_counter() - started))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--shape", default="4x128x128x128", help="one sample, e.g. 4x64x64x64")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--codecs", nargs="+", default=["zstd", "lz4"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "int16", "float16"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 8 samples of 1x16^3")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.samples, args.shape, args.repeats = 8, "1x16x16x16", 1
    shape = tuple(int(v) for v in args.shape.split("x"))
    fields = counts(args.samples, shape)
    y = np.random.default_rng(1).standard_normal((args.samples, 4)).astype(np.float32)
    cases = [(c, d) for c in args.codecs for d in args.dtypes]
    if BASELINE not in cases:
        cases.insert(0, BASELINE)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="field-codecs-") as tmp:
        for codec, dtype in cases:
            x = fields.astype(dtype)
            path = f"{tmp}/{codec}-{dtype}.zarr"
            dfl.io.to_zarr(path, x, y, compressor=codec, chunk_mb=x[0].nbytes / 2**20)
            stored = sum(f.stat().st_size for f in Path(path, "x").rglob("*") if f.is_file())
            for threads in args.threads:
                rate = read_rate(path, args.batch, threads, args.repeats)
                results.append(
                    {
                        "codec": codec,
                        "dtype": dtype,
                        "threads": threads,
                        "samples_per_s": rate,
                        "decoded_gb_per_s": rate * x[0].nbytes / 1e9,
                        "compression": x.nbytes / stored,
                    }
                )
    base = {
        r["threads"]: r["samples_per_s"] for r in results if (r["codec"], r["dtype"]) == BASELINE
    }
    for r in results:
        r["ratio_to_baseline"] = r["samples_per_s"] / base[r["threads"]]
    rows = [
        (
            r["codec"],
            r["dtype"],
            r["threads"],
            f"{r['compression']:.2f}",
            f"{r['samples_per_s']:.1f}",
            f"{r['decoded_gb_per_s']:.2f}",
            f"{r['ratio_to_baseline']:.2f}",
        )
        for r in results
    ]
    header = ("codec", "dtype", "threads", "compression", "samples/s", "GB/s", "/ zstd float32")
    print(table(rows, header))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    run = {"label": args.label, "config": config, "baseline": list(BASELINE), "results": results}
    print("saved", save_run("field_codecs", run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
