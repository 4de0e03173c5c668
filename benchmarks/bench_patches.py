"""Windows of a large array: ``PatchSource`` against xbatcher, a hand loop of zarr
window reads and a pre-cut sample-major store (issue 36, part 3).

Three cases, each on stores written here (zarr v3, zstd, smooth random fields rounded
to float16 precision as in ``bench_streaming.py``, read once before timing: a warm
page cache):

* ``crops32`` / ``crops64``: random 3-D crops (32^3, 64^3) of a ``--side``^3 float32
  volume (512^3 = 512 MiB) chunked 64^3, with a uint8 label volume beside it (the
  fit's target). As many crops as the volume holds grid windows ((512/32)^3 = 4,096;
  (512/64)^3 = 512), at uniform random corners (not aligned to the chunks).
* ``tiles``: 2-D tiles x time windows of a time x lat x lon grid (``--times`` x 256 x
  512, chunked 16 x 128 x 128): x = two time steps of a 64 x 64 tile (folded into
  channels), y = the next step; every tile at every time (stride 1 in time).

Sides, one at a time (never two at once), each giving the same windows:

* ``dataflow``: ``dfl.io.stream_batches(PatchSource(..., shuffle=True), batch)``, one
  epoch (every window once, checked; the fastest of ``--repeats`` epochs, 3, as a
  short epoch is noisy on a shared machine), ``buffer_chunks=4``, decode threads "auto";
  ``dataflow block=N`` (``--blocks``, default 64): the same with ``PatchSource(block=N)``,
  larger read units (each unit's bounding box is decoded whole: a larger block decodes
  each storage chunk fewer times, ``decoded`` in the table, and holds more memory).
  Peak memory: RSS growth over one epoch in a fresh process, against what the stream
  holds by design (``buffer_chunks + decode_ahead`` units' bounding boxes and their cut
  windows, plus ``prefetch + 4`` batch buffers). ``dataflow grid`` (crops): the grid of
  chunk-aligned, non-overlapping crops, the windows (a) reads.
* (a) ``xbatcher``: ``xbatcher.BatchGenerator`` over ``xarray.open_zarr`` of the same
  store (its own grid of windows: chunk-aligned, non-overlapping crops; for ``tiles``
  ``input_overlap={"time": 2}``), through ``torch.utils.data.DataLoader(
  xbatcher.loaders.torch.MapDataset(...), shuffle=True, num_workers=2)`` with
  forkserver-started workers (fork-started ones deadlock on a zarr v3 store). Stops
  ``--baseline-seconds`` after its first batch.
* (b) ``hand loop``: ``zarr.open_group(path)[name][z:z+P, y:y+P, x:x+P]`` for each
  window in a shuffled order, stacked into batches (for ``tiles`` one read of 3 time
  steps, split into x and y): what a user writes by hand.
* (c) ``pre-cut``: the same windows written as a sample-major store (``to_zarr``,
  8 MB chunks) and read by ``stream_batches(ZarrSource(..., shuffle=True))``: the
  ceiling (no overhang, no cutting); the fastest of ``--repeats`` epochs too.

Figures: crops/s over the whole epoch (for (a): after its first batch, its worker
processes' start-up left out, in its favour; each side's first batch is printed).
Ratios against the issue's targets: dataflow >= 5x (a), >= 0.9x (c), peak
memory within what the stream holds (PASS/MISS; nothing asserts). Then a training
fit's throughput: a small CNN (3-D segmentation for the crops, a 2-D forecast for
the tiles), ``Pipeline.fit(epochs=--fit-epochs)`` on one LocalCluster of 2
single-threaded workers, on the ``PatchSource`` and on the pre-cut ``ZarrSource``:
samples per second of training (``history.info["train_seconds"]``) and their ratio;
the Load stage's share of each replica's stage time says how long the step waited.
The xbatcher + DataLoader fit is not run (its crops/s already bounds it).

Every side waits for a quiet machine and is rerun when other programs used CPU
meanwhile (``quiet.measure_side``, the README's shared machine guard). Results are
appended to ``benchmarks/results/patches.json``.

    pip install xbatcher          # or pip install -e .[bench]; without it (a) is skipped
    python benchmarks/bench_patches.py            # 512^3 volume, ~5 min on 2 cores
    python benchmarks/bench_patches.py --quick    # 256^3 volume, ~2.5 min
    python benchmarks/bench_patches.py --cases crops32 --no-fit
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_streaming import Pass, read_raw, store_bytes, timed  # noqa: E402
from cli_args import add_quiet_args  # noqa: E402
from quiet import measure_side  # noqa: E402
from records import save_run, table  # noqa: E402
from workloads import OptimConfig, OptimizerFactory, ship_to_workers  # noqa: E402

import dataflow as dfl  # noqa: E402

NAME = "patches"
TARGETS = {"vs_xbatcher": 5.0, "vs_precut": 0.9}
BUFFER_SLACK = 4  # io.stream's output buffers beyond prefetch


# -- cases and data -------------------------------------------------------------------


@dataclass
class Case:
    """One kind of window: the store, the array, the patch and which windows."""

    name: str
    store: Path
    var: str
    y: str  # the fit's target array (the crops' labels, the grid itself)
    dims: tuple[str, ...]
    patch: dict[str, int]
    stride: dict[str, int] = field(default_factory=dict)
    corners: np.ndarray | None = None  # explicit windows (None: the grid)
    source_options: dict[str, Any] = field(default_factory=dict)

    def stream_source(self, block: int | None = None, grid: bool = False) -> Any:
        """What the crops/s sides read: x only for crops, x and its target for tiles
        (as the baselines read all three time steps); ``grid``: the grid of windows
        (chunk-aligned crops, xbatcher's) instead of the random corners."""
        return self.source(with_y=self.name == "tiles", block=block, grid=grid)

    def source(self, *, with_y: bool, block: int | None = None, grid: bool = False) -> Any:
        y = self.y if with_y else None
        options = dict(self.source_options)
        if not with_y:  # x only: y_shift/y_patch describe a target that is not read
            options = {k: v for k, v in options.items() if not k.startswith("y_")}
        return dfl.io.PatchSource(
            str(self.store),
            self.var,
            y,
            patch=self.patch,
            stride=self.stride or None,
            windows=None if grid else self.corners,
            shuffle=True,
            block=block,
            **options,
        )


def smooth_field(shape: tuple[int, ...], generator: torch.Generator) -> np.ndarray:
    """A smooth random field (upsampled 1/8-resolution noise plus 5 % noise), rounded to
    float16 precision so zstd finds some redundancy."""
    coarse = torch.randn((1, 1, *[max(2, s // 8) for s in shape]), generator=generator)
    mode = "trilinear" if len(shape) == 3 else "bilinear"
    field_ = F.interpolate(coarse, size=shape, mode=mode, align_corners=False)[0, 0]
    field_ += 0.05 * torch.randn(shape, generator=generator)
    return field_.half().float().numpy()


def write_array(group: Any, name: str, shape, chunks, dtype, dims, slabs: Iterable) -> None:
    import zarr

    array = group.create_array(
        name,
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        compressors=zarr.codecs.ZstdCodec(level=3),
        dimension_names=dims,
        fill_value=0,
    )
    for start, block in slabs:
        array[start : start + len(block)] = block


def write_volume(path: Path, side: int, chunk: int, seed: int) -> np.ndarray:
    """``v`` (float32) and ``label`` (uint8, ``v > 0``), dims (z, y, x); returns ``v``."""
    import zarr

    g = torch.Generator().manual_seed(seed)
    volume = np.empty((side,) * 3, dtype=np.float32)
    for z in range(0, side, chunk):  # slab by slab: smooth within each slab
        volume[z : z + chunk] = smooth_field((chunk, side, side), g)
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    dims = ("z", "y", "x")
    slabs = [(z, volume[z : z + chunk]) for z in range(0, side, chunk)]
    write_array(group, "v", volume.shape, (chunk,) * 3, "float32", dims, slabs)
    labels = [(z, (s > 0).astype(np.uint8)) for z, s in slabs]
    write_array(group, "label", volume.shape, (chunk,) * 3, "uint8", dims, labels)
    return volume


def write_grid(path: Path, times: int, lat: int, lon: int, seed: int) -> np.ndarray:
    """``t2m`` (time, lat, lon) float32, chunked 16 x 128 x 128; returns it."""
    import zarr

    g = torch.Generator().manual_seed(seed)
    grid = np.stack([smooth_field((lat, lon), g) for _ in range(times)])
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    chunks = (16, min(128, lat), min(128, lon))
    slabs = [(t, grid[t : t + 16]) for t in range(0, times, 16)]
    write_array(group, "t2m", grid.shape, chunks, "float32", ("time", "lat", "lon"), slabs)
    return grid


def cut(array: np.ndarray, corners: np.ndarray, extent: tuple[int, ...]) -> np.ndarray:
    """The windows of ``array`` at ``corners`` (one per row), stacked."""
    out = np.empty((len(corners), *extent), dtype=array.dtype)
    for k, c in enumerate(corners.tolist()):
        out[k] = array[tuple(slice(a, a + e) for a, e in zip(c, extent, strict=True))]
    return out


def write_precut(case: Case, source: Any, data: np.ndarray, path: Path) -> None:
    """(c): the source's windows, in its sample order, as a sample-major store."""
    corners = source.corners
    if case.name == "tiles":
        both = cut(data, corners, (3, case.patch["lat"], case.patch["lon"]))
        x, y = both[:, :2], both[:, 2:]
    else:
        p = case.patch["z"]
        x = cut(data, corners, (p, p, p))[:, None]
        y = (x[:, 0] > 0).astype(np.uint8)  # the label volume is v > 0
    dfl.io.to_zarr(path, x, y, chunk_mb=8.0)


# -- the sides -------------------------------------------------------------------------


class PeakRss:
    """The reading process's RSS growth over a ``with`` block (sampled every 10 ms)."""

    def __enter__(self) -> PeakRss:
        import psutil

        self._process = psutil.Process()
        self.start = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


def stream(source: Any, args: argparse.Namespace, memory: dict[str, Any] | None = None) -> Pass:
    """One shuffled epoch of ``stream_batches``; every sample once, or the figure is void."""
    seen: list[np.ndarray] = []

    def size(b: Any) -> int:
        seen.append(np.asarray(b.indices))
        return int(b.x.shape[0])

    def batches() -> Iterator[Any]:
        return dfl.io.stream_batches(
            source, args.batch, seed=args.seed, buffer_chunks=args.buffer_chunks
        )

    with PeakRss() as rss:
        result = timed(batches, size)
    order = np.sort(np.concatenate(seen))
    if not np.array_equal(order, np.arange(source.num_samples)):
        raise RuntimeError(f"{source!r}: the epoch did not give every window exactly once")
    if memory is not None:
        memory["rss_growth_bytes"] = rss.growth
    return result


def decoded_measured(source: Any, args: argparse.Namespace) -> tuple[float, int]:
    """Storage chunk bytes decoded in one shuffled epoch per crop byte, counted by the
    decoders (after the chunk cache and x/y sharing): the read amplification as run; and
    the most bytes the decoded-chunk cache held at once in that epoch."""
    stream(source, args)
    decoders = {id(a.reader.decoder): a.reader.decoder for a in source._open() if a.reader}
    decoded = sum(sum(d.decoded) for d in decoders.values() if d is not None)
    caches = {id(d.cache): d.cache for d in decoders.values() if d and d.cache is not None}
    peak = sum(getattr(c, "peak_bytes", 0) for c in caches.values())
    arrays = source._open()
    crop = math.prod(source.sample_shape) + math.prod(source.y_shape or (0,))
    return decoded / (crop * arrays[0].dtype.itemsize * source.num_samples), peak


def held_by_design(source: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What a PatchSource stream reads and holds by design: each unit's bounding box is
    decoded whole (every storage chunk it touches: ``decoded_over_crops`` is the read
    amplification), and it holds at most ``buffer_chunks`` units being drawn from and
    ``decode_ahead`` (2) being read, each its box plus its cut windows, and
    ``prefetch + 4`` output batches (its fixed cost), and the decoded chunks it caches:
    counted at the budget the user set (``chunk_cache_mb``), what it may hold."""
    arrays = source._open()
    item = arrays[0].dtype.itemsize
    sizes, boxes, decoded = [], [], 0
    for members in source.chunk_members:
        sizes.append(len(members))
        for k, (lo, hi) in enumerate(source._boxes(members)):  # x, then y
            if k == 0:
                boxes.append(math.prod(b - a for a, b in zip(lo, hi, strict=True)))
            chunks = arrays[k].unit or arrays[k].shape
            touched = math.prod(-(-b // c) - a // c for a, b, c in zip(lo, hi, chunks, strict=True))
            decoded += touched * math.prod(chunks) * arrays[k].dtype.itemsize
    crop_bytes = math.prod(source.sample_shape) + math.prod(source.y_shape or (0,))
    sample = math.prod(source.sample_shape) * item
    unit = max(b * item + n * sample for b, n in zip(boxes, sizes, strict=True))
    batches = (2 + BUFFER_SLACK) * args.batch * sample
    fixed = (args.buffer_chunks + 2) * unit + batches
    budget = int(source.chunk_cache_mb * 2**20)
    return {
        "block": source.block,
        "units": len(sizes),
        "windows_per_unit_mean": float(np.mean(sizes)),
        "unit_box_bytes_max": max(boxes) * item,
        "decoded_bytes": decoded,
        "decoded_over_crops": decoded / (crop_bytes * item * source.num_samples),
        "fixed_bytes": fixed,
        "cache_budget_bytes": budget,
        "held_bytes": fixed + budget,
    }


def probe_memory(
    case: Case, precut: Path | None, args: argparse.Namespace, variant: tuple = (None, False)
) -> int:
    """Peak RSS growth of a fresh process over one epoch of the case's dataflow stream
    (``precut``: of the pre-cut store's), after opening the source: a fresh process, as
    the timed sides leave freed memory in this one's heap."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_probe, (case, precut, args, variant))


def _probe(case: Case, precut: Path | None, args: argparse.Namespace, variant: tuple) -> int:
    source = precut_source(case, precut) if precut else case.stream_source(*variant)
    memory: dict[str, Any] = {}
    stream(source, args, memory)
    return memory["rss_growth_bytes"]


def hand_loop(case: Case, corners: np.ndarray, args: argparse.Namespace) -> Pass:
    """(b) One zarr read per window, in a shuffled order, stacked into batches."""
    import zarr

    order = np.random.default_rng(args.seed).permutation(len(corners))
    extent = [case.patch[d] for d in case.dims]
    if case.name == "tiles":
        extent[0] += 1  # x's two steps and y's one, in one read

    def batches() -> Iterator[np.ndarray]:
        array = zarr.open_group(str(case.store), mode="r")[case.var]
        for start in range(0, len(order), args.batch):
            rows = corners[order[start : start + args.batch]].tolist()
            yield np.stack(
                [
                    array[tuple(slice(a, a + e) for a, e in zip(c, extent, strict=True))]
                    for c in rows
                ]
            )

    return timed(batches, len)


def xbatcher_loader(case: Case, args: argparse.Namespace) -> Pass:
    """(a) xbatcher's BatchGenerator through a DataLoader with forkserver workers."""
    import xarray as xr
    import xbatcher
    from xbatcher.loaders.torch import MapDataset

    input_dims = dict(case.patch)
    overlap = {}
    if case.name == "tiles":
        input_dims["time"] = 3  # two input steps and the target step
        overlap = {"time": 2}

    def batches() -> Iterator[Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = xr.open_zarr(str(case.store), consolidated=False)[[case.var]]
        generator = xbatcher.BatchGenerator(ds, input_dims=input_dims, input_overlap=overlap)
        return iter(
            torch.utils.data.DataLoader(
                MapDataset(generator),
                batch_size=args.batch,
                shuffle=True,
                num_workers=args.loader_workers,
                multiprocessing_context="forkserver",
                generator=torch.Generator().manual_seed(args.seed),
            )
        )

    return timed(batches, lambda b: int(b.shape[0]), args.baseline_seconds)


# -- training --------------------------------------------------------------------------


class SegNet3D(torch.nn.Module):
    """Per-voxel logits at full resolution from a 1/4-resolution trunk (cheap)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv3d(1, 8, 4, stride=4),
            torch.nn.ReLU(),
            torch.nn.Conv3d(8, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.ConvTranspose3d(8, 1, 4, stride=4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)[:, 0]


class ForecastNet2D(torch.nn.Module):
    """The next time step of a tile from the two before (channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(2, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 1, 3, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def segmentation_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, y.float())


def fit(client: Any, case: Case, source: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One fit on the warm cluster: samples/s of training and the Load stage's share."""
    crops = case.name != "tiles"
    pipe = dfl.Pipeline(
        model=SegNet3D if crops else ForecastNet2D,
        device="cpu",
        loss=segmentation_loss if crops else F.mse_loss,
        optimizer=OptimizerFactory(OptimConfig(lr=args.fit_lr, momentum=0.9)),
        source=source,
        schedule=dfl.schedule.Fixed(args.fit_batch),
        buffer_chunks=args.buffer_chunks,
        seed=args.seed,
        progress=False,
    )
    started = time.perf_counter()
    result = pipe.fit(epochs=args.fit_epochs, client=client)
    wall = time.perf_counter() - started
    history = result.history
    for epoch in range(args.fit_epochs):  # every window once per epoch, or the figure is void
        assert len(result.ledger.consumed(epoch)) == source.num_samples
    phases = history.phases
    replicas = len(phases[0]["stage_seconds"])
    stages = [
        {
            k: sum(p["stage_seconds"][r].get(k, 0.0) for p in phases)
            for k in phases[0]["stage_seconds"][r]
        }
        for r in range(replicas)
    ]
    samples = sum(s["samples"] for s in history.steps)
    return {
        "samples": samples,
        "steps": len(history.steps),
        "fit_call_seconds": wall,
        "train_seconds": history.info["train_seconds"],
        "samples_per_second": samples / history.info["train_seconds"],
        "stage_seconds": stages,
        "load_share": [s.get("Load", 0.0) / sum(s.values()) for s in stages],
        "first_loss": history.steps[0]["loss"],
        "last_loss": history.steps[-1]["loss"],
    }


# -- driver ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="256^3 volume, 64 times: ~2.5 min")
    p.add_argument("--cases", default="crops32,crops64,tiles", help="comma separated")
    p.add_argument("--side", type=int, default=None, help="volume side (512; --quick 256)")
    p.add_argument("--times", type=int, default=None, help="grid time steps (128; --quick 64)")
    p.add_argument("--batch", type=int, default=32, help="crops per batch, every side (32)")
    p.add_argument("--buffer-chunks", type=int, default=4, help="PatchSource's mixing knob (4)")
    p.add_argument(
        "--chunk-cache-mb", type=float, default=256.0, help="PatchSource(chunk_cache_mb=) (256)"
    )
    p.add_argument(
        "--blocks",
        default="64",
        help="extra dataflow sides with PatchSource(block=N), comma separated ('' for none)",
    )
    p.add_argument("--loader-workers", type=int, default=2, help="(a)'s DataLoader workers (2)")
    p.add_argument(
        "--baseline-seconds",
        type=float,
        default=12.0,
        help="(a) stops this long after its first batch (12)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="epochs of each stream side; the fastest (3)"
    )
    p.add_argument("--no-fit", action="store_true", help="crops/s only, no training fits")
    p.add_argument("--fit-epochs", type=int, default=2)
    p.add_argument("--fit-batch", type=int, default=32)
    p.add_argument("--fit-lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="where to write the stores (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the stores afterwards")
    add_quiet_args(p)
    p.set_defaults(retries=1, max_wait=10.0, max_foreign=0.3)  # a short run on a busy node
    p.add_argument("--label", default="", help="a note kept with the run (which engine, why)")
    p.add_argument("--out", help="JSON file (default benchmarks/results/patches.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file instead of appending")
    args = p.parse_args(argv)
    args.blocks = [int(b) for b in args.blocks.split(",") if b]
    args.side = args.side or (256 if args.quick else 512)
    args.times = args.times or (64 if args.quick else 128)
    return args


def make_cases(args: argparse.Namespace, root: Path) -> tuple[list[Case], dict[str, np.ndarray]]:
    names = args.cases.split(",")
    rng = np.random.default_rng(args.seed)
    cases, data = [], {}
    if any(n.startswith("crops") for n in names):
        data["volume"] = write_volume(root / "volume.zarr", args.side, 64, args.seed)
    for name in names:
        if name.startswith("crops"):
            p = int(name[len("crops") :])
            n = max(256, (args.side // p) ** 3)  # as many random crops as grid windows
            corners = rng.integers(0, args.side - p + 1, size=(n, 3))
            patch = {"z": p, "y": p, "x": p}
            cases.append(
                Case(
                    name,
                    root / "volume.zarr",
                    "v",
                    "label",
                    ("z", "y", "x"),
                    patch,
                    corners=corners,
                    source_options={"chunk_cache_mb": args.chunk_cache_mb},
                )
            )
        elif name == "tiles":
            data["grid"] = write_grid(root / "grid.zarr", args.times, 256, 512, args.seed + 1)
            options = {"y_shift": {"time": 2}, "y_patch": {"time": 1}, "channels": ("time",)}
            options["chunk_cache_mb"] = args.chunk_cache_mb
            patch = {"time": 2, "lat": 64, "lon": 64}
            cases.append(
                Case(
                    name,
                    root / "grid.zarr",
                    "t2m",
                    "t2m",
                    ("time", "lat", "lon"),
                    patch,
                    {"time": 1},
                    source_options=options,
                )
            )
        else:
            raise SystemExit(f"--cases: unknown case {name!r} (crops32, crops64, crops<P>, tiles)")
    return cases, data


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def case_ratio(case: Case) -> float:
    import zarr

    array = zarr.open_group(str(case.store), mode="r")[case.var]
    return array.nbytes / store_bytes(case.store / case.var)


def precut_ratio(precut: Path) -> float:
    import zarr

    return zarr.open_group(str(precut), mode="r")["x"].nbytes / store_bytes(precut / "x")


def best(run: Any, repeats: int) -> Pass:
    """The fastest of ``repeats`` epochs (the least disturbed; short epochs are noisy)."""
    return max((run() for _ in range(repeats)), key=lambda p: p.whole_rate)


def rate_of(side: str, p: Pass) -> float:
    """Crops/s over the whole epoch, or for (a) after its first batch (its worker
    processes' start-up left out, in its favour)."""
    return p.steady_rate if side == "a xbatcher" else p.whole_rate


def precut_source(case: Case, precut: Path) -> Any:
    return dfl.io.ZarrSource(str(precut), "x", "y" if case.name == "tiles" else None)


def measure_case(
    case: Case, data: np.ndarray, root: Path, args: argparse.Namespace, xbatcher: bool
) -> dict[str, Any]:
    """Every side's crops/s on ``case``, its pre-cut store written first."""
    quiet = {"retries": args.retries, "max_wait": args.max_wait, "max_foreign": args.max_foreign}
    out: dict[str, Any] = {"patch": case.patch, "stride": case.stride}
    source = case.stream_source()
    corners = source.corners
    precut = root / f"{case.name}-precut.zarr"
    t = time.perf_counter()
    write_precut(case, source, data, precut)
    for store in (case.store, precut):
        read_raw(store)
    out.update(
        windows=source.num_samples,
        sample_shape=source.sample_shape,
        sample_bytes=4 * (math.prod(source.sample_shape) + math.prod(source.y_shape or (0,))),
        store_bytes=store_bytes(case.store / case.var),
        precut_bytes=store_bytes(precut / "x"),
    )
    variants = {
        "dataflow": (None, False),
        **{f"dataflow block={b}": (b, False) for b in args.blocks},
    }
    if case.corners is not None:  # the grid's chunk-aligned crops: (a)'s windows
        variants["dataflow grid"] = (None, True)
    reads = {k: held_by_design(case.stream_source(*v), args) for k, v in variants.items()}
    for k, v in variants.items():
        ratio, peak = decoded_measured(case.stream_source(*v), args)
        reads[k]["decoded_measured"], reads[k]["cache_peak_bytes"] = ratio, peak
    print(
        f"\n{case.name}: {source.num_samples} windows of {source.sample_shape} "
        f"({source.num_samples * out['sample_bytes'] / 2**20:.0f} MiB) in "
        f"{reads['dataflow']['units']} units of {reads['dataflow']['windows_per_unit_mean']:.1f}"
        f" windows; pre-cut store written in {time.perf_counter() - t:.0f} s; zstd ratio "
        f"{case_ratio(case):.2f} (the array), {precut_ratio(precut):.2f} (pre-cut x)",
        flush=True,
    )
    plan = [
        (k, lambda v=v: best(lambda: stream(case.stream_source(*v), args), args.repeats))
        for k, v in variants.items()
    ]
    if xbatcher:
        plan.append(("a xbatcher", lambda: xbatcher_loader(case, args)))
    plan.append(("b hand loop", lambda: hand_loop(case, corners, args)))
    plan.append(
        ("c pre-cut", lambda: best(lambda: stream(precut_source(case, precut), args), args.repeats))
    )
    sides = {}
    for side, fn in plan:
        sides[side] = measure_side(f"{case.name} {side}", fn, **quiet)
        p = sides[side][0]
        print(
            f"    {rate_of(side, p):,.0f} crops/s (first batch {p.first_batch_seconds:.2f} s)",
            flush=True,
        )
    print("  peak memory of each stream, each in a fresh process ...", flush=True)
    for side, v in variants.items():
        reads[side]["rss_growth_bytes"] = probe_memory(case, None, args, v)
    precut_rss = probe_memory(case, precut, args)
    rate = {k: rate_of(k, v[0]) for k, v in sides.items()}
    out["sides"] = {k: {**v[0].as_dict(), "quiet": v[1]} for k, v in sides.items()}
    out["crops_per_second"] = rate
    out["reads"] = reads
    out["precut_rss_growth_bytes"] = precut_rss
    out["ratios"] = {
        "vs_xbatcher": rate["dataflow"] / rate["a xbatcher"] if "a xbatcher" in rate else None,
        "vs_hand_loop": rate["dataflow"] / rate["b hand loop"],
        "vs_precut": rate["dataflow"] / rate["c pre-cut"],
        "rss_over_held": reads["dataflow"]["rss_growth_bytes"] / reads["dataflow"]["held_bytes"],
    }
    return out


def print_crops(cases: dict[str, Any]) -> None:
    rows = []
    for name, out in cases.items():
        for side, r in out["crops_per_second"].items():
            mib = r * out["sample_bytes"] / 2**20
            ratio = out["crops_per_second"]["dataflow"] / r
            read = out["reads"].get(side)
            decoded = ""
            if read:
                decoded = f"{read['decoded_over_crops']:.1f}x / {read['decoded_measured']:.1f}x"
            memory = ""
            if read:
                memory = (
                    f"{read['rss_growth_bytes'] / 2**20:.0f} / {read['held_bytes'] / 2**20:.0f}"
                )
            elif side == "c pre-cut":
                memory = f"{out['precut_rss_growth_bytes'] / 2**20:.0f}"
            rows.append([name, side, f"{r:,.0f}", f"{mib:,.0f}", f"{ratio:.2f}x", decoded, memory])
    header = [
        "case",
        "side",
        "crops/s",
        "MiB/s",
        "dataflow / side",
        "decoded box / run",
        "peak / held MiB",
    ]
    print("\n" + table(rows, header))
    for name, out in cases.items():
        r, m = out["ratios"], out["reads"]["dataflow"]
        parts = [f"vs (c) {r['vs_precut']:.2f}x {verdict(r['vs_precut'] >= TARGETS['vs_precut'])}"]
        if r["vs_xbatcher"] is not None:
            ok = r["vs_xbatcher"] >= TARGETS["vs_xbatcher"]
            parts.insert(0, f"vs (a) {r['vs_xbatcher']:.1f}x {verdict(ok)}")
        parts.append(
            f"peak RSS growth {m['rss_growth_bytes'] / 2**20:.0f} MiB, held by design "
            f"{m['held_bytes'] / 2**20:.0f} MiB (fixed {m['fixed_bytes'] / 2**20:.0f} + cache "
            f"budget {m['cache_budget_bytes'] / 2**20:.0f}; the cache held at most "
            f"{m['cache_peak_bytes'] / 2**20:.0f}) {verdict(r['rss_over_held'] <= 1.0)}"
        )
        print(f"{name}: " + "; ".join(parts))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        import xbatcher  # noqa: F401
    except ImportError:
        has_xbatcher = False
        print("xbatcher is not installed (pip install xbatcher): (a) is skipped")
    else:
        has_xbatcher = True
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_patches-"))
    root.mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = {"args": vars(args), "label": args.label, "cases": {}}
    try:
        t = time.perf_counter()
        cases, data = make_cases(args, root)
        print(f"{NAME}: stores written in {root} in {time.perf_counter() - t:.0f} s", flush=True)
        for case in cases:
            array = data["grid" if case.name == "tiles" else "volume"]
            run["cases"][case.name] = measure_case(case, array, root, args, has_xbatcher)
        print_crops(run["cases"])
        if not args.no_fit:
            run["fits"] = fits(cases, root, args)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    path = save_run(NAME, run, args.out, overwrite=args.overwrite)
    print(f"saved to {path}")
    return run


def fits(cases: list[Case], root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Each case's fit on the PatchSource and on the pre-cut ZarrSource, one warm cluster."""
    import cloudpickle

    from dataflow.runtime.cluster import client_or_local_cluster

    ship_to_workers()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the models, the loss
    quiet = {"retries": args.retries, "max_wait": args.max_wait, "max_foreign": args.max_foreign}
    out: dict[str, Any] = {}
    rows = []
    with client_or_local_cluster(None, n_workers=2, announce=False) as client:
        for case in cases:
            precut = str(root / f"{case.name}-precut.zarr")
            sources = {
                "dataflow": case.source(with_y=True),
                "c pre-cut": dfl.io.ZarrSource(precut, "x", "y"),
            }
            result: dict[str, Any] = {}
            for side, source in sources.items():
                name = f"{case.name} fit {side}"
                r, q = measure_side(name, lambda c=case, s=source: fit(client, c, s, args), **quiet)
                result[side] = {**r, "quiet": q}
                print(
                    f"    {r['samples_per_second']:,.0f} samples/s, "
                    f"Load share {np.mean(r['load_share']):.0%}",
                    flush=True,
                )
                rows.append(
                    [
                        case.name,
                        side,
                        f"{r['samples_per_second']:,.0f}",
                        f"{np.mean(r['load_share']):.1%}",
                        f"{r['train_seconds']:.1f}",
                    ]
                )
            ratio = (
                result["dataflow"]["samples_per_second"] / result["c pre-cut"]["samples_per_second"]
            )
            result["ratio"] = ratio
            out[case.name] = result
            ok = verdict(ratio >= TARGETS["vs_precut"])
            rows.append([case.name, "dataflow / pre-cut", f"{ratio:.2f}x {ok}", "", ""])
    print("\n" + table(rows, ["case", "fit on", "samples/s", "Load share", "train s"]))
    return out


if __name__ == "__main__":
    main()
