"""The cost model against published scaling results, and its 1..4,096-worker table.

Builds each model from cited constants only (``dataflow.costmodel.presets``: NCCL
v2.30.7-1 latencies, nccl-tests bus bandwidths, DeepLearningExamples / Horovod / Goyal
et al. throughputs) and prints, for Horovod (512 GPUs), Goyal et al. (8 -> 256 GPUs) and
Hu et al. 2022 (1,024 GPUs, assumed hardware), the published efficiency, the model's, the
difference in points and where the lost efficiency goes term by term; then the weak
scaling table of the ResNet-50 H100/NDR preset. Pure arithmetic: well under a second.

    python benchmarks/bench_costmodel_published.py
    python benchmarks/bench_costmodel_published.py --preset resnet50-a100-hdr --overwrite
"""

from __future__ import annotations

import argparse
import time

from records import save_run

from dataflow.costmodel import presets, scaling

NAME = "costmodel_published"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="resnet50-h100-ndr")
    parser.add_argument("--local-batch", type=int, default=None)
    parser.add_argument("--max-workers", type=int, default=scaling.MAX_WORKERS)
    parser.add_argument("--out", default=None, help="JSON path (default results/<name>.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace earlier runs")
    args = parser.parse_args()

    started = time.perf_counter()
    rows = scaling.published()
    print("published scaling results vs the cost model (cited constants, no tuning)\n")
    print(scaling.format_published(rows))

    model = presets.model(args.preset)
    local = args.local_batch or int(model.notes["local_batch"])
    table = scaling.weak_scaling(model, local_batch=local, max_workers=args.max_workers)
    print(f"\n{args.preset}: weak scaling at local batch {local} ({model.topology.algorithm})\n")
    print(scaling.format_rows(table))
    seconds = time.perf_counter() - started

    run = {
        "preset": args.preset,
        "local_batch": local,
        "seconds": seconds,
        "published": [r.to_dict() for r in rows],
        "scaling": [r.to_dict() for r in table],
        "notes": dict(model.notes),
        "sources": [list(s) for s in presets.sources()],
    }
    print(f"\nsaved {save_run(NAME, run, args.out, overwrite=args.overwrite)}")


if __name__ == "__main__":
    main()
