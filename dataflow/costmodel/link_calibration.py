"""The link term of a calibration: allreduces timed with the engine's own process group,
fitted with the α-β model (the driver side; :mod:`dataflow.runtime.probe` runs them)."""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Sequence
from typing import Any

from dataflow.core.errors import ConfigError
from dataflow.costmodel.collective import Link, Topology
from dataflow.costmodel.model import MIB


def fit_alpha_beta(times: dict[int, float]) -> tuple[float, float]:
    """``(a, b)`` of ``t(n) = a + b n``, robust to the outliers of a busy machine
    (Theil-Sen): ``b`` the median slope between sizes of 1 MiB and more (all sizes if
    fewer than two are), ``a`` the median of ``t - b n``; ``a, b >= 0``."""
    pts = sorted((int(n), float(t)) for n, t in times.items() if t > 0)
    if not pts:
        raise ConfigError("no allreduce timings to fit")
    large = [p for p in pts if p[0] >= MIB]
    use = large if len(large) >= 2 else pts
    slopes = [(t1 - t0) / (n1 - n0) for i, (n0, t0) in enumerate(use) for n1, t1 in use[i + 1 :]]
    b = max(0.0, statistics.median(slopes)) if slopes else 0.0
    a = max(0.0, statistics.median(t - b * n for n, t in pts))
    return a, b


def measure_allreduce(
    client: Any,
    workers: Sequence[str],
    sizes: Sequence[int],
    *,
    repeats: int = 7,
    timeout_s: float = 60.0,
    threads: int | None = None,
    device: str = "auto",
) -> tuple[dict[int, float], str]:
    """({bytes: seconds}, backend): the median time of one allreduce of each of
    ``sizes`` bytes with the engine's process group over ``workers`` (at least 2; the
    slowest rank's median per size). What :func:`calibrate` fits the link from, and
    what a benchmark compares the fitted link's predictions with at other sizes."""
    from dataflow.runtime import probe
    from dataflow.runtime.tasks import open_rendezvous

    world = len(workers)
    if world < 2:
        raise ConfigError(f"measure_allreduce(workers=...): give at least 2, got {world}")
    run_id = f"calibrate-{uuid.uuid4().hex[:8]}"
    host, port = client.submit(
        open_rendezvous, run_id, world, timeout_s, workers=[workers[0]], pure=False
    ).result()
    futures = [
        client.submit(
            probe.allreduce_times,
            probe.Group(run_id, rank, world, host, port, timeout_s),
            tuple(sizes),
            repeats,
            threads,
            device,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
        )
        for rank, worker in enumerate(workers)
    ]
    per_rank = client.gather(futures)
    times = {n: max(r["times"][n] for r in per_rank) for n in per_rank[0]["times"]}
    return times, per_rank[0]["backend"]


def calibrated_topology(
    client: Any, workers: list[str], sizes: Sequence[int], repeats: int, config: Any
) -> tuple[Topology, str]:
    world = len(workers)
    hosts = [_host(w) for w in workers]
    per_node = max(hosts.count(h) for h in set(hosts))
    if world < 2:
        link = Link(
            latency_s=0.0,
            bandwidth=1e12,
            name="loopback",
            source="not measured: one worker, no collective",
        )
        note = "not measured: one worker, so no allreduce runs (a loopback link stands in)"
        return Topology(intra=link, per_node=1, algorithm="ring"), note
    times, backend = measure_allreduce(
        client,
        workers,
        sizes,
        repeats=repeats,
        timeout_s=float(config.collective_timeout_s),
        threads=config.threads_per_replica,
        device=config.device,
    )
    a, b = fit_alpha_beta(times)
    alpha = a / (2 * (world - 1))
    beta = 2 * (world - 1) / world / b if b > 0 else 1e12
    where = "one node" if len(set(hosts)) == 1 else f"{len(set(hosts))} nodes"
    link = Link(
        latency_s=alpha,
        bandwidth=beta,
        name=f"measured {backend}",
        source=f"calibrated: allreduces over {world} workers on {where}",
    )
    inter = None if len(set(hosts)) == 1 else link
    table = ", ".join(f"{n} B: {t * 1e6:.0f} us" for n, t in sorted(times.items()))
    note = (
        f"the engine's process group ({backend}) over {world} workers ({where}): median of "
        f"{repeats} allreduces per size ({table}); t(n) = a + b n fitted (Theil-Sen): "
        f"a = {a * 1e6:.1f} us, b = {b * 1e9:.3f} ns/B; ring closed form inverted: "
        f"α = a / 2(W-1), β = 2(W-1)/W / b"
    )
    return Topology(intra=link, inter=inter, per_node=per_node, algorithm="ring"), note


def _host(address: str) -> str:
    from urllib.parse import urlparse

    return urlparse(address).hostname or address
