"""``Pipeline.predict(stitch=True)`` against the sliding-window loop a user writes.

Two fields in zarr, each a model's per-cell output put back where its windows lie
(overlapping windows averaged):

- ``tiles``: two N x N variables in 64 x 64 windows every 48 cells (a 2-D
  segmentation, 3 classes);
- ``slab``: a 16 x N x N volume in 16 x 64 x 64 windows every 48 cells across, one
  window deep (a 3-D model on a thin volume, 2 outputs).

Sides, best of ``--repeats`` interleaved runs (the machine is shared):

- ``hand``: the user's loop: the field read whole into memory, windows cut with numpy
  in the engine's order and batch size, summed and counted in numpy, the mean written
  to a zarr array, no workers;
- ``engine``: ``predict(..., stitch=True)`` in this process;
- ``engine, 2 workers``: the same on a LocalCluster of 2 single-threaded workers, each
  writing its share of the field's row chunks;
- ``slab, depth cut`` (the slab only): the cut before session 42, rows of the first
  patch axis, which one window spans, so every share computed every window.

Each side's field must equal the hand loop's. ``windows computed`` counts the windows
the shares run (a window over a share's edge runs in both), from the same pure layout
the engine uses.

    python benchmarks/bench_stitch.py                  # N = 768, ~2 minutes on 2 cores
    python benchmarks/bench_stitch.py --size 384 --repeats 1

Appends the run to ``benchmarks/results/stitch.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
import zarr

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save_run  # noqa: E402

import dataflow as dfl  # noqa: E402
from dataflow import stitching  # noqa: E402
from dataflow.evaluation import contiguous_shares  # noqa: E402
from dataflow.io.writer import create_field_array  # noqa: E402


class Seg(torch.nn.Module):
    """Two padded convolutions: an output per cell of the window (``conv``: 2-D or 3-D)."""

    conv: type = torch.nn.Conv2d
    widths: tuple[int, int, int] = (2, 16, 3)

    def __init__(self) -> None:
        super().__init__()
        c_in, hidden, c_out = self.widths
        self.a = self.conv(c_in, hidden, 3, padding=1)
        self.b = self.conv(hidden, c_out, 3, padding=1)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


class Seg2d(Seg):
    pass


class Seg3d(Seg):
    conv, widths = torch.nn.Conv3d, (1, 8, 2)


def workloads(root: str, size: int) -> dict[str, tuple]:
    """name -> (PatchSource, model, the field as the hand loop loads it: channels first,
    read whole)."""
    rng = np.random.default_rng(0)
    tiles = zarr.open_group(f"{root}/tiles.zarr", mode="w")
    for name in ("a", "b"):
        tiles.create_array(
            name,
            data=rng.normal(size=(size, size)).astype(np.float32),
            chunks=(256, 256),
            dimension_names=("lat", "lon"),
        )
    slab = zarr.open_group(f"{root}/slab.zarr", mode="w")
    slab.create_array(
        "x",
        data=rng.normal(size=(16, size, size)).astype(np.float32),
        chunks=(16, 256, 256),
        dimension_names=("depth", "lat", "lon"),
    )
    across = {"lat": 64, "lon": 64}, {"lat": 48, "lon": 48}
    torch.manual_seed(0)
    return {
        "tiles": (
            dfl.io.PatchSource(
                f"{root}/tiles.zarr", ["a", "b"], patch=across[0], stride=across[1], shuffle=False
            ),
            Seg2d().eval(),
            lambda: np.stack([tiles["a"][...], tiles["b"][...]]),
        ),
        "slab": (
            dfl.io.PatchSource(
                f"{root}/slab.zarr",
                "x",
                patch={"depth": 16, **across[0]},
                stride={"depth": 16, **across[1]},
                shuffle=False,
            ),
            Seg3d().eval(),
            lambda: slab["x"][...][None],
        ),
    }


def hand_loop(source, model, load, out: str, batch: int) -> str:
    """The field whole in memory, windows cut by hand, sums and counts in numpy."""
    field = load()
    patch = tuple(int(p) for p in source.geometry.patch)
    corners = np.asarray(source.corners)
    sums = counts = None
    with torch.no_grad():
        for start in range(0, len(corners), batch):
            cut = [
                field[(slice(None), *(slice(c, c + p) for c, p in zip(corner, patch, strict=True)))]
                for corner in corners[start : start + batch]
            ]
            output = model(torch.from_numpy(np.stack(cut))).numpy()
            if sums is None:
                sums = np.zeros((output.shape[1], *field.shape[1:]))
                counts = np.zeros(field.shape[1:])
            for corner, values in zip(corners[start : start + batch], output, strict=True):
                where = tuple(slice(c, c + p) for c, p in zip(corner, patch, strict=True))
                sums[(slice(None), *where)] += values
                counts[where] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (sums / counts[None]).astype(np.float32)
    mean[:, counts == 0] = np.nan
    rows_dim = 1 + stitching.field_layout(source).rows_dim  # chunked as the engine writes
    create_field_array(out, "prediction", mean.shape, rows_dim, owner="bench")
    zarr.open_group(out, mode="r+")["prediction"][...] = mean
    return out


def engine(pipe, source, model, out: str, batch: int, client=None) -> str:
    pipe.predict(source, model, out, stitch=True, batch_size=batch, client=client)
    return out


def windows_computed(source, workers: int, written: str, share=None) -> tuple[int, int]:
    """(windows the shares run, windows) for ``workers`` shares of whole row chunks of
    the field ``predict_field`` wrote at ``written`` (``share``: the cut's patch axis,
    when forced)."""
    layout = stitching.field_layout(source)
    if share is not None:
        layout = dataclasses.replace(layout, share=share)
    per_chunk = zarr.open_group(written)["prediction"].chunks[1 + layout.rows_dim]
    computed = sum(
        len(layout.windows_touching(lo, hi))
        for lo, hi in contiguous_shares(layout.rows, workers, per_chunk)
    )
    return computed, len(layout.corners)


def best_of(repeats: int, sides: dict) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=768, help="fields are N x N across")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # the fields' edges past the last window are NaN, as they are in the hand loop's
    warnings.filterwarnings("ignore", "predict\\(stitch=True\\).*covered by no window")
    from distributed import Client, LocalCluster

    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        for name, (source, model, load) in workloads(tmp, args.size).items():
            pipe = dfl.Pipeline(model=type(model), loss=F.mse_loss, device="cpu", progress=False)
            runs = iter(range(10**6))

            def target(side: str) -> str:
                return f"{tmp}/{name}-{side}-{next(runs)}.zarr"  # noqa: B023

            sides = {
                "hand": lambda s=source, m=model, f=load: hand_loop(
                    s, m, f, target("hand"), args.batch
                ),
                "engine": lambda p=pipe, s=source, m=model: engine(
                    p, s, m, target("engine"), args.batch
                ),
                "engine, 2 workers": lambda p=pipe, s=source, m=model: engine(
                    p, s, m, target("cluster"), args.batch, client
                ),
            }
            if name == "slab":

                def depth_cut(p=pipe, s=source, m=model) -> str:
                    with mock.patch.object(stitching, "share_axis", lambda corners: 0):
                        return engine(p, s, m, target("depth"), args.batch, client)

                sides["slab, depth cut, 2 workers"] = depth_cut
            fields = {side: run() for side, run in sides.items()}  # warm, and checked
            want = zarr.open_group(fields["hand"])["prediction"][...]
            for side, path in fields.items():
                got = zarr.open_group(path)["prediction"][...]
                np.testing.assert_allclose(
                    got, want, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=f"{name}, {side}"
                )
            seconds = best_of(args.repeats, sides)
            computed = {
                side: windows_computed(source, 2, fields[side], share=share)
                for side, share in (("engine, 2 workers", None), ("slab, depth cut, 2 workers", 0))
                if side in fields
            }
            for side, t in seconds.items():
                ran, windows = computed.get(side, (source.num_samples, source.num_samples))
                row = {
                    "field": name,
                    "side": side,
                    "seconds": round(t, 3),
                    "windows": windows,
                    "windows_computed": ran,
                    "hand / side": round(seconds["hand"] / t, 2),
                }
                rows.append(row)
                print(
                    f"{name:>5} {side:>27}: {t:7.3f} s  {windows / t:8.1f} windows/s  "
                    f"{ran:5d} of {windows} computed  hand/side {row['hand / side']:.2f}"
                )
    config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    path = save_run("stitch", {"config": config, "rows": rows}, args.out, overwrite=args.overwrite)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
