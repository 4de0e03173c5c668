"""The wait at each epoch's start: the next epoch's reads started early, against not.

The Load stage chains a phase's epochs (``EpochChunkReader.then``): once an epoch's
chunks are all decoded, the next epoch's first chunks decode on the idle threads while
the epoch's last batches are taken. Without that ("apart", the baseline in the same
run), every epoch's first batch waits for a whole round of decodes: the chunks that
the shuffle buffer draws its first batch from. A short epoch (the small GPU CNN's 32
steps) pays that wait every ~0.2 s.

The data are random-normal float32 samples (``--shape``, default the GPU bench's small
CNN, 3 x 64 x 64) in a store ``to_zarr`` writes with ``--codec``; the epochs are a
``Fixed(--batch)`` pipeline's sample plan; a consumer sleeps ``--step-ms`` a batch (the
step), so the reader works ahead of it as the loader thread does in a fit.

    python benchmarks/bench_epoch_chain.py                       # zstd and lz4, 2 threads
    python benchmarks/bench_epoch_chain.py --tiny --out /tmp/e.json   # a smoke run

Prints each side's median wait for epochs 2 on and its samples/s (median of
``--repeats``, interleaved), with chained / apart, and appends the run to
``benchmarks/results/epoch_chain.json``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save_run, table  # noqa: E402
from workloads import fit_batches  # noqa: E402

import dataflow as dfl  # noqa: E402
from dataflow.io.batch_buffers import BatchBuffers  # noqa: E402
from dataflow.io.chunk_reader import EpochChunkReader  # noqa: E402


def read_epochs(
    source: dfl.io.ZarrSource,
    epochs: list[list[np.ndarray]],
    threads: int,
    step_s: float,
    chained: bool,
    buffers: BatchBuffers,
) -> tuple[float, float]:
    """(median seconds waited for the first batch of epochs 2 on, samples/s overall)."""
    readers = [EpochChunkReader(source, e, buffers=buffers, decode_threads=threads) for e in epochs]
    if chained:
        for reader, after in itertools.pairwise(readers):
            reader.then = after
    waits, samples, started = [], 0, time.perf_counter()
    for reader in readers:
        batches = iter(reader)
        asked = time.perf_counter()
        for position, batch in enumerate(batches):
            if position == 0:
                waits.append(time.perf_counter() - asked)
            samples += batch.size
            time.sleep(step_s)
    return statistics.median(waits[1:]), samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--shape", default="3x64x64", help="one sample, e.g. 3x64x64")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--codecs", nargs="+", default=["zstd", "lz4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the consumer's sleep a batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 256 small samples")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.samples, args.shape, args.batch, args.epochs, args.repeats = 256, "2x8x8", 16, 3, 1
        args.step_ms = 0.0
    shape = tuple(int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, args.samples)
    results = []
    with tempfile.TemporaryDirectory(prefix="epoch-chain-") as tmp:
        for codec in args.codecs:
            path = f"{tmp}/{codec}.zarr"
            chunk_mb = 0.01 if args.tiny else 8.0  # the tiny run: several chunks an epoch
            dfl.io.to_zarr(path, x, y, compressor=codec, chunk_mb=chunk_mb)
            source = dfl.io.ZarrSource(path, y="y")
            epochs = fit_batches(source, args.batch, args.epochs)
            buffers = BatchBuffers(keep=6)
            read_epochs(source, epochs[:2], args.threads, 0.0, True, buffers)  # warm up
            runs: dict[str, list[tuple[float, float]]] = {"apart": [], "chained": []}
            for _ in range(args.repeats):  # interleaved: a drift reaches both sides
                for side in runs:
                    figures = read_epochs(
                        source, epochs, args.threads, args.step_ms / 1e3, side == "chained", buffers
                    )
                    runs[side].append(figures)
            for side, figures in runs.items():
                results.append(
                    {
                        "codec": codec,
                        "side": side,
                        "first_batch_wait_ms": statistics.median(w for w, _ in figures) * 1e3,
                        "samples_per_s": statistics.median(r for _, r in figures),
                        "repeats": [{"wait_ms": w * 1e3, "samples_per_s": r} for w, r in figures],
                    }
                )
    by = {(r["codec"], r["side"]): r for r in results}
    for r in results:
        r["rate_vs_apart"] = r["samples_per_s"] / by[(r["codec"], "apart")]["samples_per_s"]
    rows = [
        (
            r["codec"],
            r["side"],
            f"{r['first_batch_wait_ms']:.1f}",
            f"{r['samples_per_s']:.0f}",
            f"{r['rate_vs_apart']:.2f}",
        )
        for r in results
    ]
    header = ("codec", "epochs", "first-batch wait ms", "samples/s", "/ apart")
    print(table(rows, header))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    run = {"label": args.label, "config": config, "baseline": "apart", "results": results}
    print("saved", save_run("epoch_chain", run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
