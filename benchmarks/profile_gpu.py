"""Where a fit's step time goes on the host: Dask's stack sampler on the replica worker.

bench_gpu.py showed the fit at one rate whatever its precision (fp32 and bf16 +
channels_last both ~27 k samples/s on an H100, where the hand loop gains 1.6x): the
host, not the GPU, sets the pace. This script trains bench_gpu's net with the
worker's statistical profiler sampling every millisecond (``pause_dask_profiler=False``)
and prints the functions holding the most samples, by self and by inclusive count,
for each ``--schedule`` side (``fixed``; ``adaptive``: the noise-scale tuner at a fixed
batch). The trees are saved as JSON beside ``--out``.

    python benchmarks/profile_gpu.py --out /tmp/profile          # on a GPU
    python benchmarks/profile_gpu.py --device cpu --image 16 --samples 512 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from typing import Any

import dask
import torch.nn.functional as F
from bench_gpu import data
from gpu_models import GpuNet, sgd
from measure import steady_boundary, steady_fit


def flatten(tree: dict[str, Any]) -> tuple[Counter, Counter]:
    """Self and inclusive sample counts per ``file:function`` of a Dask profile tree
    (a frame counted once per stack in the inclusive count, recursion included)."""
    own: Counter = Counter()
    inclusive: Counter = Counter()

    def walk(node: dict[str, Any], stack: frozenset) -> None:
        desc = node.get("description", {})
        key = f"{os.path.basename(desc.get('filename', '?'))}:{desc.get('name', '?')}"
        count = node.get("count", 0)
        children = list(node.get("children", {}).values())
        own[key] += count - sum(c.get("count", 0) for c in children)
        if key not in stack:
            inclusive[key] += count
        for child in children:
            walk(child, stack | {key})

    for child in tree.get("children", {}).values():
        walk(child, frozenset())
    return own, inclusive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--schedules", nargs="*", default=["fixed", "adaptive"])
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", default="/tmp/profile_gpu")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from distributed import Client

    import dataflow as dfl
    from dataflow.runtime.cluster import start_local_cluster

    x, y = data(args)
    interval = {
        "distributed.worker.profile.interval": "1ms",
        "distributed.worker.profile.cycle": "200ms",
    }
    with dask.config.set(interval):
        cluster = start_local_cluster(1)
    with cluster, Client(cluster) as client:
        for schedule in args.schedules:
            chosen = (
                dfl.schedule.Adaptive(
                    args.batch, max_batch=args.batch, epochs_per_phase=args.epochs
                )
                if schedule == "adaptive"
                else dfl.schedule.Fixed(args.batch)
            )
            pipe = dfl.Pipeline(
                model=GpuNet,
                loss=F.cross_entropy,
                optimizer=sgd,
                source=dfl.io.ArraySource(x, y),
                schedule=chosen,
                device=args.device,
                replicas=1,
                progress=False,
                pause_dask_profiler=False,
            )
            start = time.time()
            result = pipe.fit(epochs=args.epochs, client=client)
            tree = client.profile(start=start)
            with open(f"{args.out}/{schedule}.json", "w") as f:
                json.dump(tree, f)
            own, inclusive = flatten(tree)
            total = tree.get("count", 0) or 1
            steps = result.history.steps
            steady = steady_fit(steps, steady_boundary(steps, 16))
            rate = steady.samples_per_second
            print(
                f"\n## {schedule}: {total} stack samples; "
                f"{rate:.0f} samples/s from step {steady.first}"
            )
            print("self:")
            for key, count in own.most_common(args.top):
                print(f"  {100 * count / total:5.1f} %  {key}")
            print("inclusive (dataflow, stages, ops, torch.optim, autograd):")
            shown = [
                (k, c)
                for k, c in inclusive.most_common()
                if not k.startswith(("threading.py", "thread.py", "worker.py", "utils.py"))
            ]
            for key, count in shown[: args.top]:
                print(f"  {100 * count / total:5.1f} %  {key}")


if __name__ == "__main__":
    main()
