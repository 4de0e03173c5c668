"""Does a shuffled ``PatchSource`` epoch mix well enough? Held-out scores on tasks where
order matters, at ``buffer_chunks`` 1, 4, 16 and 64, against the same windows pre-cut into an
``ArraySource(shuffle=True)`` (a full random permutation each epoch) (issue 36, part 1).

Two datasets whose statistics vary across the array, so that a batch drawn from one
region is biased, each written here as a zarr v3 store (and a second realisation of the
same law, with other noise, held out):

* ``volume``: 3-D segmentation. A ``--side``^3 volume (96^3, chunks 16^3) of smooth noise
  ``s`` plus an offset that drifts across the volume (a ramp along z, a sine along y);
  the label is ``s > 0`` voxel by voxel. A window (8^3, stride 8) sees the offset only
  through its own few voxels, so a model that trained last on one region sets its
  threshold there. Score: held-out voxel accuracy.
* ``fields``: forecasting on a time x lat x lon grid (``--times`` x 64 x 64, 128 times,
  chunks 8 x 16 x 16): ``f[t+1] = a * f[t] + b + noise`` with the persistence ``a`` and
  the offset ``b`` drifting slowly along time and latitude. x = two steps of a 16 x 16 tile
  (stride 8 along lat and lon, 2 along time), y = the next step. Score: held-out skill,
  1 - MSE / the target's variance.

Each side trains a tiny CNN (same initial weights per seed) for ``--epochs`` epochs of
batches of ``--batch`` with Adam, ``--seeds`` seeds (5) (the model's and the order's), and
scores every window of the held-out store; the table gives mean +- std over seeds.

How it trains: ``dfl.io.stream_batches`` and a hand loop in one process, not
``Pipeline.fit`` on a LocalCluster: 24 fits' start-up and window overhead would take
the whole time budget, and the order is the same, since ``stream_batches`` orders the
epoch with the function ``stages.Load`` calls (``io.sharding.shard_epoch`` over the
source's ``chunk_members`` and ``chunk_groups``; ``tests/test_patch_mixing.py`` checks
that the orders ``io.mixing`` measures are the ones ``stream_batches`` yields), for one
replica. The pre-cut side is the same windows read once and streamed from an
``ArraySource(shuffle=True)``: what a fit on them gets. Each side's mixing per batch
(``io.mixing``: distinct blocks, spread, trend) is printed beside its score.

    python benchmarks/bench_mixing.py           # ~3 min on 2 cores
    python benchmarks/bench_mixing.py --quick   # smaller stores, 2 seeds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save_run, table  # noqa: E402

import dataflow as dfl  # noqa: E402
from dataflow.io.mixing import source_mixing  # noqa: E402


def smooth_noise(rng: np.random.Generator, shape: tuple[int, ...], passes: int) -> np.ndarray:
    """Unit-variance noise smoothed by ``passes`` box filters of 3 along every axis."""
    field = rng.normal(size=shape)
    for _ in range(passes):
        for axis in range(len(shape)):
            field = (np.roll(field, 1, axis) + field + np.roll(field, -1, axis)) / 3
    return field / field.std()


def write_volume(path: Path, side: int, seed: int) -> None:
    import zarr

    rng = np.random.default_rng(seed)
    signal = smooth_noise(rng, (side, side, side), 2)
    z, y, _ = np.meshgrid(*[np.linspace(0, 1, side)] * 3, indexing="ij")
    offset = 1.5 * (z - 0.5) + 0.8 * np.sin(2 * np.pi * y)
    value = signal + offset + 0.2 * rng.normal(size=signal.shape)
    group = zarr.open_group(str(path), mode="w")
    for name, data in (("v", value.astype(np.float32)), ("label", (signal > 0).astype(np.int64))):
        array = group.create_array(
            name, shape=data.shape, chunks=(16, 16, 16), dtype=data.dtype,
            dimension_names=("z", "y", "x"),
        )  # fmt: skip
        array[...] = data


def write_fields(path: Path, times: int, seed: int) -> None:
    import zarr

    rng = np.random.default_rng(seed)
    lat = np.linspace(0, 1, 64)[None, :, None]
    f = np.zeros((times, 64, 64))
    f[0] = smooth_noise(rng, (64, 64), 3)
    for t in range(times - 1):
        phase = t / times
        a = 0.5 + 0.45 * np.cos(np.pi * (lat[0] + phase))  # persistence: 0.05..0.95
        b = 0.6 * np.sin(np.pi * (lat[0] + 2 * phase))  # an offset drifting along both
        noise = smooth_noise(rng, (64, 64), 3)
        f[t + 1] = a * f[t] + b + np.sqrt(1 - a**2) * noise
    group = zarr.open_group(str(path), mode="w")
    array = group.create_array(
        "f", shape=f.shape, chunks=(8, 16, 16), dtype=np.float32,
        dimension_names=("time", "lat", "lon"),
    )  # fmt: skip
    array[...] = f.astype(np.float32)


class SegNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv3d(1, 8, 3, padding=1)
        self.b = torch.nn.Conv3d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class ForecastNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(2, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def seg_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def seg_score(out: torch.Tensor, y: torch.Tensor) -> float:
    return float((out.argmax(1) == y).float().mean())


def fc_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y.float())


def fc_score(out: torch.Tensor, y: torch.Tensor) -> float:
    y = y.float()
    return 1.0 - float(F.mse_loss(out, y) / y.var())


class Task:
    """A dataset: its training and held-out sources, model, loss and score."""

    def __init__(
        self,
        name: str,
        train: Callable[..., Any],
        model: Callable[[], torch.nn.Module],
        loss: Callable[..., torch.Tensor],
        score: Callable[..., float],
        score_name: str,
    ) -> None:
        self.name, self.source, self.model = name, train, model
        self.loss, self.score, self.score_name = loss, score, score_name


def tasks(root: Path, args: argparse.Namespace) -> list[tuple[Task, Any, Any]]:
    """Each task with its training PatchSource (shuffled) and its held-out windows."""
    out = []
    write_volume(root / "vol.zarr", args.side, args.seed)
    write_volume(root / "vol-held.zarr", args.side, args.seed + 100)

    def volume(path: Path, shuffle: bool) -> Any:
        return dfl.io.PatchSource(
            path, "v", "label", patch={"z": 8, "y": 8, "x": 8}, shuffle=shuffle
        )

    seg = Task("volume", volume, SegNet, seg_loss, seg_score, "voxel accuracy")
    out.append((seg, volume(root / "vol.zarr", True), volume(root / "vol-held.zarr", False)))
    write_fields(root / "f.zarr", args.times, args.seed)
    write_fields(root / "f-held.zarr", args.times, args.seed + 100)

    def fields(path: Path, shuffle: bool) -> Any:
        return dfl.io.PatchSource(
            path, "f", "f",
            patch={"time": 2, "lat": 16, "lon": 16}, stride={"lat": 8, "lon": 8},
            y_shift={"time": 2}, y_patch={"time": 1}, channels=("time",), shuffle=shuffle,
        )  # fmt: skip

    fc = Task("fields", fields, ForecastNet, fc_loss, fc_score, "skill (1 - MSE/var)")
    out.append((fc, fields(root / "f.zarr", True), fields(root / "f-held.zarr", False)))
    return out


def read_all(source: Any) -> tuple[torch.Tensor, torch.Tensor]:
    batch = source.read(np.arange(source.num_samples))
    return batch.x, batch.y


def train(
    task: Task, source: Any, held: tuple, args: argparse.Namespace, seed: int, k: int
) -> float:
    """``args.epochs`` epochs of ``source`` (``stream_batches``, ``buffer_chunks=k``),
    then the score over every held-out window."""
    torch.manual_seed(seed)
    model = task.model()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        for batch in dfl.io.stream_batches(
            source, args.batch, epoch=epoch, seed=seed, buffer_chunks=k, decode_threads=1
        ):
            opt.zero_grad()
            task.loss(model(batch.x), batch.y).backward()
            opt.step()
    x, y = held
    with torch.no_grad():
        out = model(x)
    return task.score(out, y)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller stores, 2 seeds")
    p.add_argument("--side", type=int, help="volume side (96; --quick 48)")
    p.add_argument("--times", type=int, help="time steps of the fields (128; --quick 48)")
    p.add_argument("--seeds", type=int, help="seeds per side (5; --quick 2)")
    p.add_argument(
        "--buffers", default="1,4,16,64", help="buffer_chunks of the PatchSource sides (1,4,16,64)"
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="the stores' seed")
    p.add_argument("--label", default="", help="a note kept with the run")
    p.add_argument("--out", help="JSON file (default benchmarks/results/mixing.json)")
    p.add_argument("--overwrite", action="store_true", help="replace the file instead of appending")
    args = p.parse_args(argv)
    args.buffers = [int(k) for k in args.buffers.split(",") if k]
    args.side = args.side or (48 if args.quick else 96)
    args.times = args.times or (48 if args.quick else 128)
    args.seeds = args.seeds or (2 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)  # a shared machine: one core for the loop
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task, source, held_source in tasks(Path(tmp), args):
            held = read_all(held_source)
            x, y = read_all(source)
            precut = dfl.io.ArraySource(x.numpy(), y.numpy(), shuffle=True)
            mixing = source_mixing(source, args.batch, buffer_chunks=args.buffers)
            mixing = {m.order: m for m in mixing}
            sides: dict[str, list[float]] = {}
            for k in args.buffers:
                sides[f"buffer_chunks={k}"] = [
                    train(task, source, held, args, s, k) for s in range(args.seeds)
                ]
            sides["full permutation"] = [
                train(task, precut, held, args, s, 4) for s in range(args.seeds)
            ]
            rows, record = [], {}
            for order, scores in sides.items():
                m = mixing[order]
                mean, std = float(np.mean(scores)), float(np.std(scores, ddof=1))
                mix = (f"{m.units_mean:.1f}", f"{m.spread:.2f}", f"{m.trend:.2f}")
                rows.append((order, f"{mean:.4f} +- {std:.4f}", *mix))
                record[order] = {"scores": scores, "mean": mean, "std": std, "mixing": m}
            print(
                f"\n{task.name}: {source.num_samples} windows in {len(source.chunk_members)} "
                f"blocks; {task.score_name} on {len(held[0])} held-out windows, "
                f"{args.seeds} seeds, {args.epochs} epochs of {args.batch}"
            )
            print(table(rows, ("order", task.score_name, "blocks/batch", "spread", "trend")))
            results[task.name] = {
                "windows": source.num_samples,
                "blocks": len(source.chunk_members),
                "score": task.score_name,
                "sides": record,
            }
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s")
    path = save_run(
        "mixing",
        {"args": vars(args), "label": args.label, "seconds": seconds, "results": results},
        args.out,
        overwrite=args.overwrite,
    )
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
