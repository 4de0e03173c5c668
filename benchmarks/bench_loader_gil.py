"""What the loader's thread costs a step bound by the host (the GIL).

On a GPU the replica's step is bound by the host: hundreds of kernel launches a step,
each of which gives up the GIL and takes it back. The loader assembles the next batch
on a thread of its own, beside the step; whatever it does while holding the GIL, the
step waits for. On the H200 the small CNN's fit from zarr took ~1.1 ms more host time
a step in Forward and Backward than its fit from memory (issue 37's zarr/memory miss).

The step here is a torch loop made to be bound by the host (a narrow 8-layer MLP,
batch 4, one torch thread). It is timed alone, then beside a loader reading one epoch on
a thread of its own, as the Load stage's prefetch thread does. The figure is the step
time lost per batch the loader delivers: (1 - the step's rate beside / alone) x the
loader's seconds a batch. The loaders:

* ``memory``: the in-memory source's reads (numpy fancy indexing): the baseline;
* ``chunked-memory``: the zarr fit's reader (``EpochChunkReader``) over an in-memory
  ``xarray.Dataset`` cut into 8 MB chunks: its assembly alone, nothing to decode (what
  the assembly thread does on a GPU host whose decode threads keep up);
* ``zarr-<codec>``: the same reader over a zarr store: decode and assembly.

All read the fit's own sample plan (its chunk-aware shuffle) of small-CNN samples (3 x
64 x 64 float32, batches of 256). The reader decodes on its own thread
(``decode_ahead=0``) unless ``--decode-threads`` says more: on 2 cores the step and the
loader then have a core each, and what the step loses is the GIL and memory bandwidth,
not a core. Sides are timed ``--repeats`` times, interleaved; medians are reported.

A second table takes the loader's bulk steps one by one, each in a loop beside the step
(the step's rate kept): the gather and the ``crc32c`` check as they were and as they
are now, and a plain copy as the floor.

    python benchmarks/bench_loader_gil.py                  # ~1 minute on 2 cores
    python benchmarks/bench_loader_gil.py --tiny --out /tmp/g.json   # a smoke run

Appends the run to ``benchmarks/results/loader_gil.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save_run, table  # noqa: E402
from workloads import fit_batches  # noqa: E402

import dataflow as dfl  # noqa: E402
from dataflow.io.batch_buffers import BatchBuffers  # noqa: E402
from dataflow.io.chunk_reader import EpochChunkReader  # noqa: E402


class HostBoundStep:
    """A training step whose time is Python and dispatch: many tiny torch calls."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(4, 32)

    def __call__(self) -> None:
        self.optimizer.zero_grad()
        self.model(self.x).square().mean().backward()
        self.optimizer.step()

    def rate(self, seconds: float, done: threading.Event | None = None) -> float:
        """Steps a second for ``seconds``, or until ``done`` is set."""
        started, steps = time.perf_counter(), 0
        while time.perf_counter() - started < seconds and not (done and done.is_set()):
            self()
            steps += 1
        return steps / (time.perf_counter() - started)


def read_memory(source: Any, batches: list[np.ndarray], started: threading.Event) -> None:
    started.set()
    for indices in batches:
        source.read(indices)


def read_zarr(
    source: Any, batches: list[np.ndarray], threads: int, started: threading.Event
) -> None:
    ahead = {} if threads > 1 else {"decode_ahead": 0}  # one thread: decode inline
    reader = EpochChunkReader(
        source, batches, buffers=BatchBuffers(keep=6), decode_threads=threads, **ahead
    )
    batches_read = iter(reader)
    next(batches_read)  # the first batch's decode is not the steady state
    started.set()
    for _ in batches_read:
        pass


def beside(step: HostBoundStep | None, read: Any, *args: Any) -> tuple[float, float]:
    """The step's rate while ``read`` runs on a thread (``step`` None: the main thread
    waits), and the reader's seconds."""
    started, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            read(*args, started)
        except BaseException as exc:  # raised on the main thread below
            failed.append(exc)
        finally:
            started.set()
            done.set()

    thread = threading.Thread(target=run, name="loader")
    thread.start()
    started.wait()
    began = time.perf_counter()
    rate = step.rate(3600.0, done) if step is not None else 0.0
    thread.join()
    if failed:
        raise failed[0]
    return rate, time.perf_counter() - began


def primitives(batch: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """The loader's bulk steps, each in a loop on a thread beside the step: the ways
    before (numpy's ``concatenate`` of one view per sample; zarr's ``crc32c`` codec, which
    hands google_crc32c a numpy view) and now (``io.row_copy``; the check on the whole
    stored ``bytes``), with a plain copy of a batch as the floor."""
    import google_crc32c

    from dataflow.io.direct_decode import crc32c_checked
    from dataflow.io.row_copy import copy_rows

    rng = np.random.default_rng(1)
    chunks = [rng.standard_normal((160, *shape), dtype=np.float32) for _ in range(5)]
    owner, rows = rng.integers(0, 5, batch), rng.integers(0, 160, batch)
    out = np.empty((batch, *shape), np.float32)
    views = [chunks[c][r : r + 1] for c, r in zip(owner, rows, strict=True)]
    parts = [(chunks[c], rows[owner == c], np.flatnonzero(owner == c)) for c in range(5)]
    stored = chunks[0].tobytes()  # a chunk's object: its bytes, then their crc32c
    stored += np.uint32(google_crc32c.value(stored)).tobytes()
    as_stored = np.frombuffer(stored, np.uint8)
    return {
        "gather, before: concatenate of views": lambda: np.concatenate(views, axis=0, out=out),
        "gather, now: copy_rows per chunk": lambda: [copy_rows(out, *p) for p in parts],
        "crc32c, before: zarr's (a numpy view)": lambda: google_crc32c.value(as_stored[:-4]),
        "crc32c, now: crc32c_checked": lambda: crc32c_checked(as_stored),
        "floor: np.copyto of a batch": lambda: np.copyto(out, chunks[0][:1]),
    }


def in_a_loop(work: Any, seconds: float, started: threading.Event) -> None:
    started.set()
    ends = time.perf_counter() + seconds
    while time.perf_counter() < ends:
        work()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--shape", default="3x64x64", help="one sample")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--codecs", nargs="+", default=["zstd", "lz4"])
    parser.add_argument("--decode-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--step-seconds", type=float, default=1.0, help="each timing of the step alone"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a smoke run: 1,024 samples, 0.1 s timings"
    )
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.samples, args.repeats, args.step_seconds = 1024, 1, 0.1
    torch.set_num_threads(1)
    shape = tuple(int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, args.samples)
    step = HostBoundStep()
    step.rate(args.step_seconds / 2)  # warm up
    memory = dfl.io.ArraySource(x, y)
    [memory_batches] = fit_batches(memory, args.batch)
    sides: dict[str, tuple[Any, ...]] = {"memory": (read_memory, memory, memory_batches)}
    chunked = xr.Dataset({"x": (("sample", "c", "h", "w"), x), "y": (("sample",), y)})
    chunked = dfl.io.ZarrSource(chunked, x="x", y="y")
    sides["chunked-memory"] = (read_zarr, chunked, fit_batches(chunked, args.batch)[0], 1)
    with tempfile.TemporaryDirectory(prefix="loader-gil-") as tmp:
        for codec in args.codecs:
            path = f"{tmp}/{codec}.zarr"
            dfl.io.to_zarr(path, x, y, compressor=codec)
            source = dfl.io.ZarrSource(path, y="y")
            batches = fit_batches(source, args.batch)[0]
            sides[f"zarr-{codec}"] = (read_zarr, source, batches, args.decode_threads)
        for read, *read_args in sides.values():  # warm up (a kernel's first compile)
            beside(None, read, *read_args)
        kept: dict[str, list[float]] = {name: [] for name in sides}
        lost: dict[str, list[float]] = {name: [] for name in sides}
        per_batch: dict[str, list[float]] = {name: [] for name in sides}
        alone: list[float] = []
        for _ in range(args.repeats):
            for name, (read, *read_args) in sides.items():
                batches = len(read_args[1]) - 1  # (each loader's first batch is not timed)
                alone.append(step.rate(args.step_seconds))
                rate, seconds = beside(step, read, *read_args)
                kept[name].append(rate / alone[-1])
                per_batch[name].append(seconds / batches * 1e3)
                lost[name].append((1 - kept[name][-1]) * per_batch[name][-1])
    results = [
        {
            "side": name,
            "step_ms_lost_per_batch": statistics.median(lost[name]),
            "step_ms_lost_repeats": lost[name],
            "step_kept": statistics.median(kept[name]),
            "loader_ms_per_batch": statistics.median(per_batch[name]),
        }
        for name in sides
    ]
    rows = [
        (
            r["side"],
            f"{r['step_ms_lost_per_batch']:.2f}",
            " ".join(f"{v:.2f}" for v in r["step_ms_lost_repeats"]),
            f"{r['step_kept']:.2f}",
            f"{r['loader_ms_per_batch']:.2f}",
        )
        for r in results
    ]
    header = ("loader", "step ms lost a batch", "repeats", "step kept", "loader ms a batch")
    print(table(rows, header))
    steps: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, work in primitives(args.batch, shape).items():
            alone.append(step.rate(0.7 * args.step_seconds))
            kept_step = beside(step, in_a_loop, work, 0.7 * args.step_seconds)[0]
            steps.setdefault(name, []).append(kept_step / alone[-1])
    kept_beside = {name: statistics.median(values) for name, values in steps.items()}
    rows = [
        (n, f"{kept_beside[n]:.2f}", " ".join(f"{v:.2f}" for v in vs)) for n, vs in steps.items()
    ]
    print(table(rows, ("in a loop beside the step", "step kept", "repeats")))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    run = {
        "label": args.label,
        "config": config,
        "step_alone_per_s": statistics.median(alone),
        "results": results,
        "primitives_step_kept": kept_beside,
        "primitives_step_kept_repeats": steps,
    }
    print("saved", save_run("loader_gil", run, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
