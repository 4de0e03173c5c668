"""The layout model against real fits: predicted vs measured step time for each layout of
the workers (sample, spatial along each dimension, hybrid), and whether ``layout="auto"``
picks the fastest measured one.

Each layout trains the same CosmoNet (benchmarks/workloads.py, examples/cosmoflow.py's 3D
CNN) for a few windows on a LocalCluster; its measured step time is the phase's
``measured_step_seconds`` (windows after the first two). The layout model is calibrated
on the driver (``layout_choice.layout_model``: every layer timed alone at each region
size) with the link and the node-sharing slowdown of ``dfl.costmodel.calibrate`` on the
same cluster.

    python benchmarks/bench_spatial_layouts.py                 # 2 workers: sample, spatial
    python benchmarks/bench_spatial_layouts.py --workers 4     # + hybrid (oversubscribed)

Writes benchmarks/results/spatial_layouts.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import RESULTS
from workloads import CosmoNet

import dataflow as dfl
from dataflow.planning.layout_choice import layout_model


def pipeline(x, y, batch: int, layout=None, **options) -> dfl.Pipeline:
    return dfl.Pipeline(
        model=CosmoNet,
        loss=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(batch),
        layout=layout,
        progress=False,
        window_steps=2,
        **options,
    )


def as_layout(candidate) -> dfl.Layout | None:
    if candidate.spatial == 1:
        return None
    return dfl.Layout(spatial=candidate.spatial, dims=candidate.dims, grid=candidate.grid)


def measured_step(result) -> float:
    """The median step of the windows after the first two (fresh workers run the first
    steps of each shape slower)."""
    steps = result.history.steps
    seconds = [s["seconds"] for s in steps[4:]] or [s["seconds"] for s in steps]
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--side", type=int, default=32, help="volume edge (voxels)")
    parser.add_argument("--batch", type=int, default=4, help="global batch")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    from dataflow.runtime.cluster import client_or_local_cluster

    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = rng.lognormal(size=(n, 1, args.side, args.side, args.side)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    rows = []
    with client_or_local_cluster(None, n_workers=args.workers, announce=False) as client:
        started = time.perf_counter()
        cost = dfl.costmodel.calibrate(pipeline(x, y, args.batch), client)
        probe = pipeline(x, y, args.batch, cost_model=cost)
        model = layout_model(probe.trainer, calibrate=True).replace(shared=cost.compute.shared)
        candidates = model.candidates(args.workers, global_batch=args.batch)
        ranked = model.choose(candidates, global_batch=args.batch)
        calibrate_s = time.perf_counter() - started
        for prediction in ranked:
            c = prediction.candidate
            result = pipeline(x, y, args.batch, layout=as_layout(c)).fit(1, client)
            measured = measured_step(result)
            rows.append(
                {
                    "layout": c.describe(),
                    "kind": c.kind,
                    "predicted_s": prediction.step_s,
                    "measured_s": measured,
                    "error": prediction.step_s / measured - 1,
                    "prediction": prediction.to_dict(),
                }
            )
            print(
                f"{c.describe():>26}  predicted {prediction.step_s * 1e3:8.1f} ms  "
                f"measured {measured * 1e3:8.1f} ms  error {rows[-1]['error']:+.1%}",
                flush=True,
            )
    fastest = min(rows, key=lambda r: r["measured_s"])
    auto = rows[0]
    within = sum(abs(r["error"]) <= 0.20 for r in rows)
    ratio = auto["measured_s"] / fastest["measured_s"]
    verdict = "the same" if auto is fastest else f"auto's is {ratio:.2f}x slower"
    print(
        f"\n{within}/{len(rows)} layouts predicted within 20 %; auto picks {auto['layout']}, "
        f"the fastest measured is {fastest['layout']} ({verdict})"
    )
    print(f"calibration took {calibrate_s:.0f} s")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "spatial_layouts.json"
    payload = {
        "workers": args.workers,
        "side": args.side,
        "global_batch": args.batch,
        "rows": rows,
        "auto": auto["layout"],
        "fastest_measured": fastest["layout"],
        "within_20_percent": within,
        "calibrate_seconds": calibrate_s,
    }
    out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
