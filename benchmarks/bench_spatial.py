"""Spatial decomposition on this machine: the halo's cost per layer, strong scaling of
one volume over 1 and 2 workers, and the layout model's prediction of both (issue 16).

No Dask cluster: each side runs in ``dataflow.spatial.local_group.LocalGroup`` processes
(a gloo group, 1 torch thread each), the baseline in the same run.

(a) per conv layer of a CosmoFlow-like net: the partitioned conv on 2 ranks
    (``SpatialModule``, halo exchange) against the unpartitioned conv on the whole
    input in 1 process; ``split/half = t(P=2) / (t(P=1) / 2)`` (1.0: a perfect
    halving), and the same plain conv on each rank's rows at once (``plain/half``:
    what sharing the machine alone costs);
(b) the whole net's training step (forward, backward, gradient allreduce, SGD) on
    one volume: 1 worker alone; 2 workers: independent (no communication), sample
    parallel (a volume each) and spatial (one volume split): strong scaling
    ``speedup = t(1) / t(spatial)``;
(c) the layout model (``calibrate_layout`` per layer in a 1-thread process, a link
    fitted from gloo send/recv and allreduce timings in the pool, the slowdown of two
    ranks computing at once from (b)'s independent steps) predicting (b).

    nice -n 10 python benchmarks/bench_spatial.py              # 64^3, about 1.5 min
    nice -n 10 python benchmarks/bench_spatial.py --side 96    # longer, steadier

Prints the tables and appends the run to benchmarks/results/spatial.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quiet import wait_quiet
from records import save_run, table

from dataflow.costmodel.collective import Link, Topology
from dataflow.costmodel.layout_cost import LayoutCandidate
from dataflow.spatial.geometry import split_extent
from dataflow.spatial.local_group import LocalGroup
from dataflow.spatial.module import SpatialModule
from dataflow.spatial.profile import calibrate_layout
from dataflow.tools.cpu_meter import CpuMeter

LINK_SIZES = (4, 64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 1 << 20, 4 << 20)


def cosmo_net(side: int, channels: int, width: int, blocks: int) -> nn.Module:
    """CosmoFlow-like: blocks of conv3d 3^3 + BatchNorm + ReLU + maxpool 2, then a head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c, s = channels, side
    for i in range(blocks):
        w = width * 2 ** min(i, 3)
        layers += [nn.Conv3d(c, w, 3, padding=1), nn.BatchNorm3d(w), nn.ReLU(), nn.MaxPool3d(2)]
        c, s = w, s // 2
    layers += [nn.Flatten(), nn.Linear(c * s**3, 64), nn.ReLU(), nn.Linear(64, 4)]
    return nn.Sequential(*layers)


def region(x: torch.Tensor, group: Any, dim: int = 2) -> torch.Tensor:
    lo, hi = split_extent(x.shape[dim], group.size)[group.rank]
    return x.narrow(dim, lo, hi - lo).clone()


def _timed(group: Any, step: Any, warmup: int, repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``step`` after ``warmup``, each started together
    on every rank (a barrier first)."""
    flag = torch.zeros(1)
    times = []
    for i in range(warmup + repeats):
        group.allreduce_(flag)
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


# -- (a) the partitioned conv against the whole one --------------------------------------


def conv_layers(config: dict[str, int]) -> list[tuple[nn.Conv3d, tuple[int, ...]]]:
    net = cosmo_net(**config)
    out, s = [], config["side"]
    for m in net:
        if isinstance(m, nn.Conv3d):
            out.append((m, (m.in_channels, s, s, s)))
        elif isinstance(m, nn.MaxPool3d):
            s //= 2
    return out


def rank_conv_times(
    group: Any, config: dict[str, int], warmup: int, repeats: int, mode: str
) -> list[float]:
    """Median forward + backward seconds of each conv layer on this rank: ``mode``
    "whole" (the plain conv on the whole input), "local" (the plain conv on this rank's
    region and halo rows, no communication: the ranks only share the machine) or
    "spatial" (``SpatialModule``: halo exchange, interior and shells)."""
    out = []
    for conv, shape in conv_layers(config):
        x = torch.randn(1, *shape)
        layer: nn.Module = conv
        if mode == "spatial":
            layer, x = SpatialModule(nn.Sequential(conv), group, (2,)), region(x, group)
        elif mode == "local":
            lo, hi = split_extent(shape[1], group.size)[group.rank]
            lo, hi = max(0, lo - 1), min(shape[1], hi + 1)  # a 3^3 kernel's halo
            x = x[:, :, lo:hi].clone()
        x.requires_grad_(True)

        def step(layer: nn.Module = layer, x: torch.Tensor = x) -> None:
            layer(x).sum().backward()

        out.append(statistics.median(_timed(group, step, warmup, repeats)))
    return out


# -- (b) one volume on 1 and 2 workers ---------------------------------------------------


def rank_step_times(
    group: Any, config: dict[str, int], warmup: int, repeats: int, mode: str
) -> list[float]:
    """The whole net's training step: ``mode`` "alone" or "independent" (one volume per
    rank, no communication), "sample" (one volume per rank, gradients allreduced) or
    "spatial" (one volume over the group, this rank's region of it)."""
    net = cosmo_net(**config)
    torch.manual_seed(group.rank)
    x = torch.randn(1, config["channels"], *(config["side"],) * 3)
    y = torch.randn(1, 4)
    if mode == "spatial":
        net, x = SpatialModule(net, group, (2,)), region(x, group)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    reduce = group.size > 1 and mode in ("sample", "spatial")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(net(x), y).backward()
        if reduce:
            flat = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            group.allreduce_(flat)
            offset = 0
            for p in net.parameters():
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.step()

    return _timed(group, step, warmup, repeats)


# -- (c) the link and the layout model ---------------------------------------------------


def rank_link(group: Any, repeats: int, busy: int = 256) -> dict[str, Any]:
    """Median one-way send/recv (half a ping-pong) and allreduce seconds per size, on
    idle ranks; and ``loaded``: the same small messages between bouts of compute (a
    ``busy``² matmul, as a step's layers run between its halos and reductions), less
    the compute alone: what a message costs a training step here."""
    peer = 1 - group.rank
    a = torch.randn(busy, busy)

    def p2p(buf: torch.Tensor) -> None:
        first, second = (group.send, group.recv) if group.rank == 0 else (group.recv, group.send)
        group.wait([first(buf, peer, 7)])
        group.wait([second(buf, peer, 8)])

    def timed(call: Any, compute: bool) -> float:
        times = []
        for i in range(2 + repeats):
            group.allreduce_(torch.zeros(1))
            start = time.perf_counter()
            if compute:
                a @ a
            call()
            if i >= 2:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    out: dict[str, Any] = {"p2p": [], "allreduce": [], "loaded_p2p": [], "loaded_allreduce": []}
    alone = timed(lambda: None, True)
    for size in LINK_SIZES:
        buf = torch.zeros(max(1, size // 4))
        n = buf.numel() * 4
        out["p2p"].append((n, timed(lambda buf=buf: p2p(buf), False) / 2))
        out["allreduce"].append((n, timed(lambda buf=buf: group.allreduce_(buf), False)))
        if n <= 64 << 10:
            loaded = timed(lambda buf=buf: p2p(buf), True) - alone
            out["loaded_p2p"].append((n, max(0.0, loaded) / 2))
            loaded = timed(lambda buf=buf: group.allreduce_(buf), True) - alone
            out["loaded_allreduce"].append((n, max(0.0, loaded)))
    return out


def fitted_links(points: dict[str, Any], loaded: bool = True) -> tuple[Link, Link]:
    """(point to point, allreduce over 2) links, ``t = α + n/β`` for send/recv and the
    ring closed form for 2 ranks, ``t = 2α + n/β``, for the allreduce: ``β`` from the
    slope between the two largest sizes on idle ranks, ``α`` the median over the sizes
    up to 64 KiB of what is left, between bouts of compute (``loaded``) or idle (a
    least-squares line through all sizes would let the large messages set the latency,
    which the halos and the group's reductions, all small, pay)."""
    links = []
    for key, hops, name in (("p2p", 1, "gloo send/recv"), ("allreduce", 2, "gloo allreduce")):
        pts = sorted(points[key])
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        beta = (n1 - n0) / max(t1 - t0, 1e-9)
        small = points[f"loaded_{key}"] if loaded else [(n, t) for n, t in pts if n <= 64 << 10]
        alpha = statistics.median(max(0.0, t - n / beta) / hops for n, t in small)
        source = "LocalGroup(2), " + ("between bouts of compute" if loaded else "idle")
        links.append(Link(latency_s=alpha, bandwidth=beta, name=name, source=source))
    return links[0], links[1]


def rank_calibrate(group: Any, config: dict[str, int], repeats: int, link: Link) -> Any:
    net = cosmo_net(**config)
    sample = (config["channels"], *(config["side"],) * 3)
    return calibrate_layout(net, sample, link=link, spatial=(1, 2, 4), repeats=repeats)


# -- the three sections -----------------------------------------------------------------


def _rounds(calls: dict[str, Any], rounds: int) -> dict[str, list[Any]]:
    """Each call ``rounds`` times, taking turns (a burst of other work on the machine
    then slows every side alike); the results of each call concatenated per name."""
    out: dict[str, list[Any]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            out[name].append(call())
    return out


def per_layer(one: LocalGroup, two: LocalGroup, config: dict[str, int], args: Any) -> list:
    """(a): each conv layer whole on 1 process, and on 2: plain on each rank's rows
    (sharing the machine only), then partitioned (``SpatialModule``)."""
    w, r = args.warmup, args.repeats

    def on_two(mode: str) -> Any:
        return lambda: [
            max(t) for t in zip(*two.run(rank_conv_times, config, w, r, mode), strict=True)
        ]

    calls = {
        "whole": lambda: one.run(rank_conv_times, config, w, r, "whole")[0],
        "local": on_two("local"),
        "spatial": on_two("spatial"),
    }
    times = {
        k: [statistics.median(t) for t in zip(*v, strict=True)]
        for k, v in _rounds(calls, args.rounds).items()
    }
    rows, out = [], []
    layers = zip(conv_layers(config), times["whole"], times["local"], times["spatial"], strict=True)
    for i, ((_, shape), t1, local, t2) in enumerate(layers):
        overhead, shared = t2 / (t1 / 2), local / (t1 / 2)
        size = "x".join(map(str, shape))
        ms = (f"{t * 1e3:.2f}" for t in (t1, local, t2))
        rows.append((i, size, *ms, f"{shared:.2f}", f"{overhead:.2f}"))
        out.append(
            dict(layer=i, input=shape, whole_s=t1, local_s=local, split_s=t2, overhead=overhead,
                 shared_only=shared)
        )  # fmt: skip
    print("\n(a) conv forward+backward (ms): whole (1 process); on 2 ranks: plain on each")
    print("    rank's rows, partitioned; ratios to half the whole (1.0: a perfect halving)")
    header = ("conv", "input", "whole", "2 plain", "2 split", "plain/half", "split/half")
    print(table(rows, header))
    return out


def strong_scaling(one: LocalGroup, two: LocalGroup, config: dict[str, int], args: Any) -> dict:
    """(b): one volume's training step on 1 worker, and on 2: independent (the machine
    shared, nothing exchanged), sample-parallel (2 volumes) and spatial (1 volume)."""
    w, r = args.warmup, args.repeats

    def on_two(mode: str) -> Any:
        return lambda: [
            max(t) for t in zip(*two.run(rank_step_times, config, w, r, mode), strict=True)
        ]

    calls = {"alone": lambda: one.run(rank_step_times, config, w, r, "alone")[0]}
    calls.update({mode: on_two(mode) for mode in ("independent", "sample", "spatial")})
    out = {k: [t for steps in v for t in steps] for k, v in _rounds(calls, args.rounds).items()}
    med = {k: statistics.median(v) for k, v in out.items()}
    rows = [
        ("1 worker, 1 volume", f"{med['alone'] * 1e3:.1f}", f"{1 / med['alone']:.2f}"),
        ("2 independent", f"{med['independent'] * 1e3:.1f}", f"{2 / med['independent']:.2f}"),
        ("sample 2x1, 2 volumes", f"{med['sample'] * 1e3:.1f}", f"{2 / med['sample']:.2f}"),
        ("spatial 1x2, 1 volume", f"{med['spatial'] * 1e3:.1f}", f"{1 / med['spatial']:.2f}"),
    ]
    print(f"\n(b) a {config['side']}^3 volume's training step (median of {len(out['alone'])})")
    print(table(rows, ("layout", "step ms", "volumes/s")))
    speedup = med["alone"] / med["spatial"]
    print(f"    spatial strong scaling: speedup {speedup:.2f}, efficiency {speedup / 2:.0%}; "
          f"two ranks at once run {med['independent'] / med['alone']:.2f}x slower")  # fmt: skip
    return {"steps_s": out, "median_s": med, "speedup": speedup}


def predicted(model: Any, strong: dict[str, Any]) -> dict[str, Any]:
    """(c): the layout model's step for (b)'s layouts, against the measured one."""
    med = strong["median_s"]
    rows, out = [], []
    cases = (
        (LayoutCandidate(groups=1), 1, med["alone"]),
        (LayoutCandidate(groups=2), 2, med["sample"]),
        (LayoutCandidate(groups=1, spatial=2, dims=(0,), grid=(2,)), 1, med["spatial"]),
    )
    for cand, batch, measured in cases:
        p = model.predict(cand, global_batch=batch)
        err = p.step_s / measured - 1
        ms = [p.step_s, measured, None, p.compute_s, p.halo_exposed_s, p.gather_s, p.reduce_s]
        ms += [p.allreduce_exposed_s, p.fixed_s]
        cells = [f"{v * 1e3:.2f}" if v is not None else f"{err:+.1%}" for v in ms]
        rows.append((cand.describe(), *cells, f"{p.memory_bytes / (1 << 20):.1f}"))
        out.append({**p.to_dict(), "measured_s": measured, "error": err})
    print("\n(c) the layout model against (b) (ms)")
    header = ("layout", "pred", "meas", "err", "compute", "halo", "gather", "reduce")
    print(table(rows, (*header, "allreduce", "fixed", "MiB")))
    fits = {k: vars(v) for k, v in model.fits.items()}
    region = {k: vars(v) for k, v in model.region_fits.items()}
    extra = {"backward_fraction": model.backward_fraction, "shared": model.shared}
    return {"predictions": out, "fits": fits, "region_fits": region, **extra, "notes": model.notes}


# -- the engine's layouts (a later section) ---------------------------------------------


def engine_layouts(args: argparse.Namespace) -> dict[str, Any] | None:
    """The engine-level comparison of sample, spatial and hybrid layouts on a cluster
    (to come with the engine's ``layout=``); None until then."""
    del args
    return None


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=64, help="volume side (default 64)")
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--width", type=int, default=8, help="first conv's channels")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per call")
    parser.add_argument("--rounds", type=int, default=3, help="calls per side, taking turns")
    parser.add_argument("--max-wait", type=float, default=60.0, help="s to wait for quiet")
    parser.add_argument("--max-foreign", type=float, default=0.3, help="cores others may use")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    config = dict(side=args.side, channels=args.channels, width=args.width, blocks=args.blocks)
    run: dict[str, Any] = {"args": vars(args), "config": config}
    began = time.perf_counter()
    others: dict[str, float] = {}

    def section(name: str, fn: Any) -> Any:
        """``fn()`` on a quiet machine if one comes within --max-wait, with the cores
        other programs used meanwhile recorded (a disturbed section is not comparable)."""
        wait_quiet(args.max_wait)
        with CpuMeter() as meter:
            value = fn()
        others[name] = meter.foreign_cpu_seconds / max(meter.wall_seconds, 1e-9)
        if others[name] > args.max_foreign:
            print(f"    ({name}: other programs used {others[name]:.2f} cores meanwhile)")
        return value

    with LocalGroup(1) as one, LocalGroup(2) as two:
        link_points = section("link", lambda: two.run(rank_link, args.repeats)[0])
        p2p, ring = fitted_links(link_points)
        idle_p2p, idle_ring = fitted_links(link_points, loaded=False)
        run["link"] = {"points": link_points, "p2p": vars(p2p), "allreduce": vars(ring)}
        run["link"].update(idle_p2p=vars(idle_p2p), idle_allreduce=vars(idle_ring))
        print(
            f"link: send/recv {p2p.latency_s * 1e6:.0f} us ({idle_p2p.latency_s * 1e6:.0f} idle)"
            f" + n / {p2p.bandwidth / 1e9:.2f} GB/s; allreduce alpha {ring.latency_s * 1e6:.0f}"
            f" us ({idle_ring.latency_s * 1e6:.0f} idle), beta {ring.bandwidth / 1e9:.2f} GB/s"
        )
        run["per_layer"] = section("per_layer", lambda: per_layer(one, two, config, args))
        run["strong"] = section("strong", lambda: strong_scaling(one, two, config, args))
        model = section("calibrate", lambda: one.run(rank_calibrate, config, args.repeats, ring)[0])
        shared = run["strong"]["median_s"]["independent"] / run["strong"]["median_s"]["alone"]
        model = model.replace(topology=Topology(intra=ring), halo_link=p2p, shared=((2, shared),))
        run["model"] = predicted(model, run["strong"])
    run["others_cores"] = others
    print(
        "other programs' cores per section: " + ", ".join(f"{k} {v:.2f}" for k, v in others.items())
    )
    run["engine"] = engine_layouts(args)
    run["seconds"] = time.perf_counter() - began
    path = save_run("spatial", run, args.out, overwrite=args.overwrite)
    print(f"\n{run['seconds']:.0f} s; appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
