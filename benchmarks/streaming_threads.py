"""Part (f) of ``bench_streaming.py``: the decode rate with N decode threads against 1.

On the benchmark's own zstd store (``--gb``/``--samples``), in the same run:

* (f) decode: every chunk of ``x`` decoded ``DECODE_PASSES`` times, in the order one
  epoch of ``stream_batches`` first uses them, by ``N`` threads each calling
  ``ZarrSource.read_chunks([chunk])``: what ``EpochChunkReader``'s decode pool does
  (``io.zarr_decode`` decodes on the calling thread), without the batch assembly.
  At most ``2 N`` chunks in flight; each decoded chunk is dropped at once, so its slab
  is reused as in the reader.
* (f) decode, processes: the same chunks dealt out to N worker processes (started and
  warmed before the clock starts), each decoding its share with one thread: no GIL, no
  shared interpreter, the most N cores of this machine give at that moment (on a VM,
  two busy vCPUs may get less than twice one).
* (f) decode, zarr's read: the same, each call read through zarr itself
  (``AsyncArray.get_orthogonal_selection`` on zarr's event loop, decoded on zarr's
  thread pool; the path for layouts ``io.zarr_decode`` does not know): does zarr's
  own read scale with the threads that call it?
* (f) stream: one epoch of ``stream_batches(ZarrSource(...), batch,
  decode_threads=N)``, as (b): decode pool, assembly into reused batch buffers,
  prefetch thread, every sample once.
* (f) stream, before: the reader before decode threads, for reference: one thread,
  each batch's new chunks in one zarr request (zarr fetches and decodes them
  concurrently on its own pool).

Each N runs ``--repeats`` times, round robin with the other Ns, each side measured when
the machine is quiet and rerun if other programs used CPU meanwhile
(``quiet.measure_side``), or if the hypervisor took CPU from this VM (steal above
``MAX_STEAL`` cores: the threads then wait for a core they are not given); the
median is kept. Printed: samples/s, MB/s decoded, cores used, and each N's rate over
N=1's, from the medians and paired (the median over rounds of the ratio within a
round, robust to a machine whose speed drifts between rounds); the paired decode ratio
at N=2 against ``TARGET`` (PASS or MISS, nothing asserts).
"""

from __future__ import annotations

import collections
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from quiet import measure_side
from records import table

TARGET = 1.7  # decode rate with 2 threads over 1 thread, at least (a 2-core machine)
DECODE_PASSES = 3  # a decode side decodes the epoch's chunks this often: over a second
MAX_STEAL = 0.05  # cores the hypervisor may take during a side before it is rerun
ZARR_READ = "decode, zarr's read"


def epoch_chunk_order(source: Any, seed: int, buffer_chunks: int) -> list[int]:
    """The chunks of one ``stream_batches`` epoch, in the order it first uses them."""
    from dataflow.io.chunk_index import chunk_of
    from dataflow.io.sharding import shard_epoch, source_chunk_sizes

    [order] = shard_epoch(
        source_chunk_sizes(source),
        [source.num_samples],
        seed=seed,
        epoch=0,
        buffer_chunks=buffer_chunks,
    )
    chunks = chunk_of(np.asarray(source.chunk_bounds), order)
    return list(dict.fromkeys(chunks.tolist()))  # first uses, in order


def zarr_read_only(source: Any) -> Any:
    """``source`` with every array read through zarr itself (no ``io.zarr_decode``)."""
    for reader in source._open():
        if hasattr(reader, "decoder"):
            reader.decoder = None
    return source


def decode_pass(
    path: Path, threads: int, chunks: list[int], zarr_read: bool = False
) -> dict[str, Any]:
    """Decode every chunk of ``chunks`` once on ``threads`` threads; seconds and samples."""
    from dataflow.io import ZarrSource

    source = ZarrSource(str(path), "x", "y")
    if zarr_read:
        zarr_read_only(source)
    bounds = source.chunk_bounds
    samples = int(sum(bounds[c + 1] - bounds[c] for c in chunks))
    pending: collections.deque = collections.deque()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="bench-decode") as pool:
        for chunk in chunks:
            if len(pending) >= 2 * threads:
                pending.popleft().result()  # dropped at once: its slab is reused
            pending.append(pool.submit(source.read_chunks, [chunk]))
        while pending:
            pending.popleft().result()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": samples, "samples_per_second": samples / seconds}


_SOURCE: Any = None  # a process side's worker: its source, opened before the clock


def _open_source(path: str) -> None:
    from dataflow.io import ZarrSource

    global _SOURCE
    _SOURCE = ZarrSource(path, "x", "y")  # opened as decode_pass opens its own


def _decode_share(chunks: list[int]) -> int:
    for chunk in chunks:
        _SOURCE.read_chunks([chunk])
    return len(chunks)


def process_pass(path: Path, processes: int, chunks: list[int]) -> dict[str, Any]:
    """Decode ``chunks`` once, dealt out to ``processes`` one-thread worker processes."""
    from dataflow.io import ZarrSource

    bounds = ZarrSource(str(path), "x", "y").chunk_bounds
    samples = int(sum(bounds[c + 1] - bounds[c] for c in chunks))
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes, initializer=_open_source, initargs=(str(path),)) as pool:
        pool.map(_decode_share, [[] for _ in range(processes)], chunksize=1)  # all started
        t0 = time.perf_counter()
        pool.map(_decode_share, [chunks[i::processes] for i in range(processes)], chunksize=1)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": samples, "samples_per_second": samples / seconds}


def _measure(name: str, fn: Callable[[], Any], quiet_args: dict[str, Any]) -> tuple[Any, Any]:
    """``quiet.measure_side``, rerun while the hypervisor took CPU during the side."""
    for _ in range(quiet_args["retries"] + 1):
        value, q = measure_side(name, fn, **quiet_args)
        meter = q["attempts"][-1]
        steal = meter["steal_cpu_seconds"] / meter["wall_seconds"]
        q["steal_cores"] = steal
        if steal <= MAX_STEAL:
            return value, q
        print(f"    the hypervisor took {steal:.2f} cores meanwhile; rerunning", flush=True)
    q["disturbed"] = True
    return value, q


def report(
    sides: list[tuple[str, int]], results: dict[str, Any], sample_bytes: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """Print the table and the verdict of ``results`` (per side: the kept rate, the rate of
    every round, the cores used); return the ratios and the verdict. Each ratio is a side
    over its kind at N=1, two ways: the kept (median) rates, and the median over rounds
    of the ratio within a round (sides seconds apart: a machine whose speed drifts
    between rounds, as a shared VM's does, moves both alike)."""
    rate = {name: r["samples_per_second"] for name, r in results.items()}
    rounds = {name: r["repeat_rates"] for name, r in results.items()}
    rows, ratios = [], {}
    for kind, n in sides:
        one, this = f"{kind} 1", f"{kind} {n}"
        ratios[f"{this}/1"] = rate[this] / rate[one]
        paired = [a / b for a, b in zip(rounds[this], rounds[one], strict=True)]
        ratios[f"{this}/1 paired"] = statistics.median(paired)
        rows.append(
            [
                f"(f) {kind}",
                n,
                f"{rate[this]:.1f}",
                f"{rate[this] * sample_bytes / 1e6:.0f}",
                f"{results[this]['cores_used']:.2f}",
                f"{ratios[f'{this}/1']:.2f}",
                f"{ratios[f'{this}/1 paired']:.2f}",
            ]
        )
    header = ["side", "N", "samples/s", "MB/s decoded", "cores", "x N=1", "paired x N=1"]
    print(table(rows, header))
    verdict: dict[str, Any] = {}
    if "decode 2" in rate:
        ratio = ratios["decode 2/1 paired"]
        verdict = {"ratio": ratio, "target": TARGET, "pass": ratio >= TARGET}
        ratios["stream 2/before"] = rate["stream 2"] / rate["stream, before 1"]
        before = zip(rounds["stream 2"], rounds["stream, before 1"], strict=True)
        ratios["stream 2/before paired"] = statistics.median(a / b for a, b in before)
        ratios["decode 2 threads/2 processes"] = rate["decode 2"] / rate["decode, processes 2"]
        print(
            f"(f) decode rate, 2 threads / 1 thread = {ratio:.2f} paired, "
            f"{ratios['decode 2/1']:.2f} from the medians  (target >= {TARGET:g})  "
            f"{'PASS' if ratio >= TARGET else 'MISS'}\n"
            f"    2 processes / 1 (this machine's ceiling): "
            f"{ratios['decode, processes 2/1 paired']:.2f} paired; 2 threads / 2 processes: "
            f"{ratios['decode 2 threads/2 processes']:.2f}; zarr's own read, 2 threads / 1: "
            f"{ratios[ZARR_READ + ' 2/1 paired']:.2f} paired\n"
            f"    stream_batches epoch, 2 threads / 1: {ratios['stream 2/1 paired']:.2f} "
            f"paired; 2 threads / the reader before decode threads: "
            f"{ratios['stream 2/before paired']:.2f} paired"
        )
    return ratios, verdict


def run_part(
    store: Path,
    args: Any,
    quiet_args: dict[str, Any],
    sample_bytes: int,
    stream: Callable[[int, bool], Any],
) -> dict[str, Any]:
    """(f) for every N of ``args.decode_threads``; ``stream(N, zarr_read)`` runs one
    (b)-like epoch with N decode threads (through zarr's own read if ``zarr_read``) and
    returns its ``Pass``. Prints the table; returns the JSON."""
    from dataflow.io import ZarrSource

    counts = sorted({1, *(int(n) for n in args.decode_threads.split(","))})
    chunks = DECODE_PASSES * epoch_chunk_order(
        ZarrSource(str(store), "x", "y"), args.seed, args.buffer_chunks
    )
    sides: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    plan: list[tuple[str, int, Callable[[], Any]]] = []
    for n in counts:
        plan += [
            ("decode", n, lambda n=n: decode_pass(store, n, chunks)),
            ("decode, processes", n, lambda n=n: process_pass(store, n, chunks)),
            (ZARR_READ, n, lambda n=n: decode_pass(store, n, chunks, True)),
            ("stream", n, lambda n=n: stream(n, False)),
        ]
    plan.append(("stream, before", 1, lambda: stream(1, True)))
    for _ in range(args.repeats):  # round robin: a slow spell falls on every side alike
        for kind, n, fn in plan:
            value, q = _measure(f"f {kind} N={n}", fn, quiet_args)
            if not isinstance(value, dict):  # a Pass: samples/s after its first batch
                value = value.as_dict()
            meter = q["attempts"][-1]
            value["cores_used"] = meter["our_cpu_seconds"] / meter["wall_seconds"]
            value["disturbed"] = q["disturbed"]
            sides.setdefault(f"{kind} {n}", []).append((value, q))

    results: dict[str, Any] = {}
    for name, runs in sides.items():
        rates = [v["samples_per_second"] for v, _ in runs]
        kept = runs[rates.index(statistics.median_low(rates))][0]
        results[name] = {
            **{k: v for k, v in kept.items() if k not in ("ends", "sizes")},
            "repeat_rates": rates,
            "disturbed": any(v["disturbed"] for v, _ in runs),
        }
    ratios, verdict = report([(kind, n) for kind, n, _ in plan], results, sample_bytes)
    return {
        "threads": counts,
        "chunks_per_decode_side": len(chunks),
        "sides": results,
        "ratios": ratios,
        "target": verdict,
        "quiet": {name: [q for _, q in runs] for name, runs in sides.items()},
    }
