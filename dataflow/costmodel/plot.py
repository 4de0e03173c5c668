"""The scaling figure: throughput and efficiency against workers (log x-axis), and each
worker count's step time split into its terms. matplotlib is imported when a figure is
drawn (Agg backend, files only), never when the cost model is."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dataflow.core.errors import DataflowError
from dataflow.costmodel.scaling import ScalingRow

STACK = (
    ("compute_s", "compute"),
    ("data_wait_s", "data wait"),
    ("allreduce_exposed_s", "exposed allreduce"),
    ("overhead_s", "engine overhead"),
)


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise DataflowError("the scaling figure needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg", force=True)  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def write_scaling_png(rows: Sequence[ScalingRow], path: str | Path, *, title: str = "") -> Path:
    """Three panels: samples/s (log-log, with the ideal line), efficiency, and the step's
    terms stacked per worker count (milliseconds)."""
    if not rows:
        raise DataflowError("no scaling rows to plot")
    plt = _matplotlib()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    workers = [r.replicas for r in rows]
    fig, (ax_rate, ax_eff, ax_terms) = plt.subplots(1, 3, figsize=(15, 4.5))
    try:
        first = rows[0]
        ideal = [first.samples_per_second * w / first.replicas for w in workers]
        ax_rate.plot(workers, [r.samples_per_second for r in rows], "o-", label="predicted")
        ax_rate.plot(workers, ideal, "--", color="grey", label="linear")
        ax_rate.set(xscale="log", yscale="log", xlabel="workers", ylabel="samples/s")
        ax_rate.set_title("throughput")
        ax_rate.legend()
        ax_eff.plot(workers, [100 * r.efficiency for r in rows], "o-")
        ax_eff.set(xscale="log", xlabel="workers", ylabel="efficiency (%)")
        ax_eff.set_ylim(min(50.0, min(100 * r.efficiency for r in rows) - 5), 101)
        ax_eff.set_title("scaling efficiency")
        bottom = [0.0] * len(rows)
        positions = list(range(len(rows)))
        for key, label in STACK:
            values = [1e3 * getattr(r, key) for r in rows]
            if not any(values):
                continue
            ax_terms.bar(positions, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax_terms.set_xticks(positions, [str(w) for w in workers], rotation=60)
        ax_terms.set(xlabel="workers", ylabel="ms per step")
        ax_terms.set_title("step time by term")
        ax_terms.legend(fontsize="small")
        for ax in (ax_rate, ax_eff):
            ax.grid(True, which="both", alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
