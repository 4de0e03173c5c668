"""A fit from an S3-compatible store as its latency grows (issue 36, part 2).

moto's S3 server runs here, behind a proxy that holds every request ``delay`` ms
(``tests/object_store.py``). The same fit (2 workers, a small CNN, 4,096 samples of
1 x 64 x 64 float32 in 8 MB chunks, 2 epochs) runs at each delay, on one warm
LocalCluster; the throughput (samples trained per second of the fit's wall time,
dry run and all; the source is opened before the clock starts; the best of
``--repeats`` interleaved fits, as the machine is shared) is compared with the 0 ms
fit's. Target: at least 0.9x at 100 ms, for both sources:

- ``zarr``: ``ZarrSource`` over a sample-major store (x: 4,096 x 1 x 64 x 64, y: the
  4,096 class labels);
- ``patch``: ``PatchSource`` over a 2-D field of the same cells, 4,096 x 4,096 float32
  in chunks of 1,024 x 2,048 (8 MB), cut into its 4,096 tiles of 64 x 64 (a 64 x 64
  grid of them, shuffled by blocks of a storage chunk); y: the class at each tile's
  corner, from a uint8 label field beside it on the same chunk grid (2 MB objects).

    python benchmarks/bench_object_store.py                  # 0, 20, 100 ms, both sources
    python benchmarks/bench_object_store.py --delays 0 100 --sources patch
    python benchmarks/bench_object_store.py --delays 0 20 --throttle 0.05 0.2

``--throttle P ...`` adds sides at ``--throttle-delay`` ms (default 20) where the store
answers each chunk GET with S3's 503 ``SlowDown`` at probability P (a throttling
store: a retried GET may be throttled again), the clients' own retries as a user has
them; what the fit keeps of its 0 ms throughput shows what the fetch-ahead hides of
the retries' backoff (``io.store_retry`` sends again what the client gives up on).

Prints a table and appends the run to ``benchmarks/results/object_store.json``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from object_store import s3_server  # noqa: E402
from records import save_run, table  # noqa: E402
from workloads import CNN, CNNConfig, OptimConfig, OptimizerFactory, ship_to_workers  # noqa: E402

import dataflow as dfl  # noqa: E402

MODEL = CNNConfig(in_channels=1, image=64, channels=(8, 16), hidden=32, classes=10)


def tile_model() -> Any:
    """``CNN(MODEL)``'s layers as a plain ``Sequential`` (a picklable ``() -> model``): the
    loss below is defined here, so Dask pickles the fit's spec by value, which
    ``workloads.CNN`` does not survive."""
    cnn = CNN(MODEL)
    return functools.partial(copy.deepcopy, torch.nn.Sequential(*cnn.features, *cnn.head))


def tile_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against each tile's class (its y: the 1 x 1 label at its corner)."""
    return F.cross_entropy(logits, y.reshape(-1).long())


def open_source(kind: str, url: str, options: dict | None) -> Any:
    if kind == "zarr":
        return dfl.io.ZarrSource(url, x="x", y="y", storage_options=options)
    patch = {"row": 64, "col": 64}
    return dfl.io.PatchSource(
        url, "field", "label", patch=patch, y_patch={"row": 1, "col": 1}, storage_options=options
    )


def write_stores(root: Path, x: np.ndarray, y: np.ndarray, chunk_mb: float) -> dict[str, Path]:
    """The samples as a sample-major store, and as one 2-D field of tiles with labels."""
    import zarr

    stores = {"zarr": dfl.io.to_zarr(root / "train.zarr", x, y, chunk_mb=chunk_mb)}
    side = math.isqrt(len(x))  # tiles per row and column
    assert side * side == len(x), "--samples: a square number of tiles"
    field = x.reshape(side, side, 64, 64).transpose(0, 2, 1, 3).reshape(side * 64, side * 64)
    labels = np.zeros(field.shape, np.uint8)
    labels[::64, ::64] = y.reshape(side, side)
    rows = max(64, int(chunk_mb * 2**20 / 4 / min(field.shape[1], 2048)) // 64 * 64)
    chunks = (min(rows, field.shape[0]), min(2048, field.shape[1]))
    group = zarr.open_group(root / "field.zarr", mode="w")
    for name, values in (("field", field), ("label", labels)):
        array = group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype,
            chunks=chunks,
            dimension_names=("row", "col"),
        )
        array[...] = values
    stores["patch"] = root / "field.zarr"
    return stores


def fit_once(
    client: Any, kind: str, url: str, options: dict, args: argparse.Namespace
) -> tuple[float, int]:
    """The fit's seconds, and the reads its source sent again (``store_retries``)."""
    source = open_source(kind, url, options)
    pipe = dfl.Pipeline(
        model=functools.partial(CNN, MODEL) if kind == "zarr" else tile_model(),
        device="cpu",
        loss=F.cross_entropy if kind == "zarr" else tile_loss,
        optimizer=OptimizerFactory(OptimConfig(lr=0.01, momentum=0.9)),
        source=source,
        schedule=dfl.schedule.Fixed(args.batch),
        progress=False,
    )
    start = time.perf_counter()
    result = pipe.fit(epochs=args.epochs, client=client)
    seconds = time.perf_counter() - start
    for epoch in range(args.epochs):  # every sample once per epoch, or the figure is void
        assert len(result.ledger.consumed(epoch)) == args.samples
    return seconds, sum(sum(p.store_retries or []) for p in result.history.phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[0, 20, 100], help="ms")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--chunk-mb", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3, help="fits per delay; the best")
    parser.add_argument(
        "--sources", nargs="+", default=["zarr", "patch"], choices=["zarr", "patch"]
    )
    parser.add_argument("--throttle", type=float, nargs="*", default=[], help="fractions")
    parser.add_argument("--throttle-delay", type=float, default=20.0, help="ms")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if 0 not in args.delays:
        args.delays = [0.0, *args.delays]
    sides = [(d, 0.0) for d in args.delays] + [(args.throttle_delay, t) for t in args.throttle]
    ship_to_workers()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 1, 64, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=args.samples).astype(np.int64)
    from dataflow.runtime.cluster import client_or_local_cluster

    rows, runs = [], []
    with tempfile.TemporaryDirectory() as tmp, s3_server() as s3:
        local = write_stores(Path(tmp), x, y, args.chunk_mb)
        urls = {kind: s3.upload(local[kind], local[kind].name) for kind in args.sources}
        objects = {
            "zarr": len(dfl.io.ZarrSource(local["zarr"], x="x", y="y").chunk_bounds) - 1,
            "patch": len(open_source("patch", str(local["patch"]), None).chunk_members),
        }
        with client_or_local_cluster(None, n_workers=2, announce=False) as client:
            s3.proxy.delay = 0.0
            for kind in args.sources:  # warm: imports, first fit
                fit_once(client, kind, urls[kind], s3.storage_options, args)
            times = {(k, side): [] for k in args.sources for side in sides}
            counts: dict[tuple[str, tuple], dict] = {}
            for _ in range(args.repeats):  # interleaved: a busy spell hits every side
                for kind in args.sources:
                    for side in sides:
                        s3.proxy.delay, s3.proxy.throttle = side[0] / 1000, side[1]
                        s3.proxy.reset_counts()
                        seconds, retries = fit_once(
                            client, kind, urls[kind], s3.storage_options, args
                        )
                        times[kind, side].append(seconds)
                        counts[kind, side] = {
                            "requests": dict(s3.proxy.methods),
                            "peak_chunk_gets": s3.proxy.peak_chunk_gets,
                            "throttled_gets": s3.proxy.failed_chunk_gets,
                            "store_retries": retries,
                        }
                s3.proxy.throttle = 0.0
            for kind in args.sources:
                for side in sides:
                    seconds = min(times[kind, side])  # the least disturbed of the repeats
                    runs.append(
                        {
                            "source": kind,
                            "delay_ms": side[0],
                            "throttle": side[1],
                            "fit_s": seconds,
                            "fit_s_all": times[kind, side],
                            "samples_per_s": args.samples * args.epochs / seconds,
                            **counts[kind, side],
                        }
                    )
    for r in runs:
        base = next(
            b
            for b in runs
            if b["source"] == r["source"] and b["delay_ms"] == 0 and not b["throttle"]
        )
        r["vs_0ms"] = r["samples_per_s"] / base["samples_per_s"]
        gets = r["requests"].get("GET", 0)
        heads = r["requests"].get("HEAD", 0)
        rows.append(
            [
                r["source"],
                f"{r['delay_ms']:g}",
                f"{r['throttle']:.0%}",
                f"{r['fit_s']:.2f}",
                f"{r['samples_per_s']:.0f}",
                f"{r['vs_0ms']:.2f}x",
                f"{gets}/{heads}",
                r["peak_chunk_gets"],
                f"{r['throttled_gets']}/{r['store_retries']}",
            ]
        )
    header = [
        "source",
        "delay ms",
        "SlowDown",
        "fit s",
        "samples/s",
        "vs 0 ms",
        "GET/HEAD",
        "GETs at once",
        "503s/retried",
    ]
    print(
        f"{args.samples} samples of 1x64x64 ({objects['zarr']} sample-major chunks, "
        f"{objects['patch']} blocks of tiles) of {args.chunk_mb:g} MB, {args.epochs} epochs, "
        f"2 workers, batch {args.batch}"
    )
    print(table(rows, header))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    path = save_run(
        "object_store",
        {"config": {**config, "chunks": objects}, "rows": runs},
        args.out,
        overwrite=args.overwrite,
    )
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
