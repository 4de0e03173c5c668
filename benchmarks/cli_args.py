"""The command-line options the benchmarks that compare dataflow with a hand-written
baseline share (argparse helpers)."""

from __future__ import annotations

from typing import Any


def add_workload_args(
    p: Any, *, samples: int, epochs: int, channels: str, convs: int, hidden: int
) -> None:
    """The model, data and optimizer options both benchmarks share (defaults differ)."""
    p.add_argument("--samples", type=int, default=samples, help=f"dataset size ({samples})")
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--epochs", type=int, default=epochs, help=f"epochs per side ({epochs})")
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="steps excluded at the start, rounded up to a window end (default 10)",
    )
    p.add_argument("--channels", default=channels, help=f"conv widths per stage ({channels})")
    p.add_argument("--convs", type=int, default=convs, help=f"3x3 convs per stage ({convs})")
    p.add_argument(
        "--hidden", type=int, default=hidden, help=f"hidden units of the head ({hidden})"
    )
    p.add_argument("--image", type=int, default=32, help="image side, 3 channels (default 32)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-seconds", type=float, default=1.0, help="dataflow window_seconds")


def add_worker_args(p: Any) -> None:
    """Diagnosis switches for the dataflow side's Dask workers (defaults: as users get)."""
    p.add_argument(
        "--worker-malloc-trim",
        choices=("dask-default", "unset", "mallopt"),
        default="dask-default",
        help="dask-default: workers get distributed.nanny.pre-spawn-environ as usual "
        "(MALLOC_TRIM_THRESHOLD_=65536); unset: drop that variable; mallopt: keep it but "
        "call glibc mallopt() in the workers before the fit (diagnosis)",
    )
    p.add_argument(
        "--engine-relax-malloc",
        choices=("on", "off"),
        default="on",
        help="off: Pipeline(relax_malloc=False), the engine leaves Dask's malloc setting "
        "in place (reproduces the slowdown fixed in f58fd53; default on)",
    )
    p.add_argument(
        "--worker-gc-freeze",
        action="store_true",
        help="gc.collect() + gc.freeze() in the workers after importing torch/dataflow, "
        "before the fit (diagnosis: full-collection pauses)",
    )
    p.add_argument(
        "--worker-profile",
        choices=("on", "off"),
        default="on",
        help="off: distributed.worker.profile.enabled=False, no 10 ms stack sampling of the "
        "task thread (diagnosis; default on, as users get)",
    )


def add_quiet_args(p: Any) -> None:
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="reruns of a side disturbed by other programs on the machine (default 2)",
    )
    p.add_argument(
        "--max-wait",
        type=float,
        default=120.0,
        help="seconds to wait for a quiet machine before each side (default 120)",
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="cores used by other programs during a side above which it is rerun (0.1)",
    )
