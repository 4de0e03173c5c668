"""A held-out evaluation from a zarr store, local and on S3 as its latency grows.

``Evaluate.evaluate_shard`` (the engine: a chunked store read as training reads one,
each chunk decoded once and an object store's GETs many at once, ``io.chunk_reader``)
against the loop a user writes: each held-out batch read with ``source.read`` on a
thread one batch ahead of the model (the engine's own path before session 27). Both
score the same model on the same batches, and their sums must agree. moto's S3 server
runs here behind a proxy that holds every request ``delay`` ms (``tests/object_store.py``).

    python benchmarks/bench_evaluate_reads.py                 # 0 and 50 ms, and local
    python benchmarks/bench_evaluate_reads.py --delays 0 20 100 --samples 4096

Prints a table (best of ``--repeats`` interleaved runs: the machine is shared) and
appends the run to ``benchmarks/results/evaluate_reads.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from object_store import s3_server  # noqa: E402
from records import save_run  # noqa: E402
from test_evaluate_transforms import last_step  # noqa: E402  (a 1-replica epoch's end)

import dataflow as dfl  # noqa: E402
from dataflow import stages  # noqa: E402
from dataflow.io.prefetch import Prefetcher  # noqa: E402

METRICS = {"loss": F.cross_entropy, "accuracy": stages.accuracy}


def model_of(size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * size * size, 3),
    )


def corner_class(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A tile's class: its label field's value at the tile's corner."""
    return F.cross_entropy(output, y.reshape(len(y), -1)[:, 0])


TILE_METRICS = {"loss": corner_class}


def tile_source(root: str, size: int, field: str = "held.zarr") -> dfl.io.PatchSource:
    """The 32 x 32 tiles (stride 16) of a 2 x SIZE x SIZE float32 field in chunks of
    2 x 256 x 256, with a class field beside it; not shuffled (a held-out set)."""
    import zarr

    rng = np.random.default_rng(1)
    group = zarr.open_group(f"{root}/{field}", mode="w")
    group.create_array("field", data=rng.normal(size=(2, size, size)).astype(np.float32),
                       chunks=(2, 256, 256))  # fmt: skip
    group.create_array("lab", data=rng.integers(0, 3, size=(1, size, size)),
                       chunks=(1, 256, 256))  # fmt: skip
    tiles = {1: 32, 2: 32}
    return dfl.io.PatchSource(
        f"{root}/{field}", "field", "lab", patch=tiles, stride={1: 16, 2: 16}, shuffle=False
    )


def engine(source, model, batch: int, metrics=METRICS) -> dict[str, float]:
    evaluate = stages.Evaluate(source, metrics=metrics, batch_size=batch, transforms=())
    return evaluate.evaluate_shard(last_step(evaluate, model))


def hand_loop(source, model, batch: int, metrics=METRICS) -> dict[str, float]:
    """Each batch read with ``source.read``, one batch ahead of the model."""
    n = source.num_samples
    batches = [np.arange(s, min(n, s + batch)) for s in range(0, n, batch)]
    reading = Prefetcher(source.read, batches)
    sums = dict.fromkeys(metrics, 0.0)
    model.eval()
    try:
        with torch.no_grad():
            for _ in batches:
                got = reading.get()
                output = model(torch.as_tensor(got.x))
                for key, fn in metrics.items():
                    sums[key] += float(fn(output, torch.as_tensor(got.y))) * got.size
    finally:
        reading.close()
        model.train()
    return {"count": n, **sums}


def best_of(repeats: int, sides: dict) -> dict[str, tuple[float, dict]]:
    """Each side's best time over ``repeats`` interleaved runs, and its scores."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    scores: dict[str, dict] = {}
    for _ in range(repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            scores[name] = run()
            times[name].append(time.perf_counter() - start)
    return {name: (min(times[name]), scores[name]) for name in sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[0, 50], help="ms")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--size", type=int, default=32, help="samples are 1 x SIZE x SIZE")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunk-samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--field", type=int, default=1024, help="the window side: tiles of a 2 x N x N field"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 1, args.size, args.size)).astype(np.float32)
    y = rng.integers(0, 3, size=args.samples).astype(np.int64)
    chunk_mb = args.chunk_samples * x[0].nbytes / 1e6
    model = model_of(args.size)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, s3_server() as s3:
        local = dfl.io.to_zarr(f"{tmp}/held.zarr", x, y, chunk_mb=chunk_mb)
        url = s3.upload(local, "held.zarr")
        places = [("local", None)] + [(f"s3 {d:g} ms", d) for d in args.delays]
        for label, delay in places:
            if delay is None:
                source = dfl.io.ZarrSource(local, x="x", y="y")
            else:
                source = dfl.io.ZarrSource(url, x="x", y="y", storage_options=s3.storage_options)
                s3.proxy.delay = delay / 1000
            sides = {
                "engine": lambda s=source: engine(s, model, args.batch),
                "hand": lambda s=source: hand_loop(s, model, args.batch),
            }
            engine(source, model, args.batch)  # warm: the store's metadata, the threads
            measured = best_of(args.repeats, sides)
            s3.proxy.delay = 0.0
            (t_engine, got), (t_hand, want) = measured["engine"], measured["hand"]
            for key in METRICS:
                assert np.isclose(got[key], want[key], rtol=1e-5), (label, key, got, want)
            rows.append(
                {
                    "store": label,
                    "engine_s": round(t_engine, 4),
                    "hand_s": round(t_hand, 4),
                    "hand / engine": round(t_hand / t_engine, 2),
                    "chunks": len(source.chunk_bounds) - 1,
                }
            )
            print(
                f"{label:>12}: engine {t_engine:.3f} s, batch-by-batch {t_hand:.3f} s, "
                f"{t_hand / t_engine:.2f}x ({rows[-1]['chunks']} chunks)"
            )
        # windows of a field (PatchSource, local): read batch by batch, each batch
        # reads again every unit (a run of windows in C order) it touches
        tiles = tile_source(tmp, args.field)
        tile_model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2 * 32 * 32, 3))
        sides = {
            "engine": lambda: engine(tiles, tile_model, args.batch, TILE_METRICS),
            "hand": lambda: hand_loop(tiles, tile_model, args.batch, TILE_METRICS),
        }
        sides["engine"]()
        measured = best_of(args.repeats, sides)
        (t_engine, got), (t_hand, want) = measured["engine"], measured["hand"]
        assert np.isclose(got["loss"], want["loss"], rtol=1e-5), (got, want)
        label = f"tiles {args.field}"
        units = len(tiles.chunk_members)
        rows.append(
            {
                "store": f"{label} (PatchSource, local)",
                "engine_s": round(t_engine, 4),
                "hand_s": round(t_hand, 4),
                "hand / engine": round(t_hand / t_engine, 2),
                "windows": tiles.num_samples,
                "units": units,
            }
        )
        print(
            f"{label:>12}: engine {t_engine:.3f} s, batch-by-batch {t_hand:.3f} s, "
            f"{t_hand / t_engine:.2f}x ({tiles.num_samples} windows in {units} units)"
        )
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    path = save_run(
        "evaluate_reads", {"config": config, "rows": rows}, args.out, overwrite=args.overwrite
    )
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
