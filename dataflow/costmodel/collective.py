"""Allreduce time under the α-β model: ring, tree and two-level, one bucket at a time.

A message of ``n`` bytes over one link costs ``α + n / β`` (``α``: latency per hop in
seconds, ``β``: bandwidth in bytes/s). The closed forms are those NCCL's tuner uses
(NVIDIA/nccl ``src/graph/tuning.cc``): a ring allreduce takes ``2 (W - 1)`` steps, of
which ``2 (nodes - 1)`` cross nodes, and moves ``2 (W - 1) / W`` of the buffer through
each rank; a (double binary) tree allreduce climbs and descends ``log2(nodes)`` levels
between nodes and ``gpus_per_node - 1`` inside one, at half the bus bandwidth (every
byte goes up and down). Pure: no torch, no Dask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dataflow.core.errors import ConfigError

ALGORITHMS = ("ring", "tree", "two_level", "best")


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of hop: ``latency_s`` per message step, ``bandwidth`` in bytes/s (the bus
    bandwidth one rank gets, as nccl-tests reports it). ``source`` cites where the figures
    come from (a paper, a datasheet, a calibration)."""

    latency_s: float
    bandwidth: float
    name: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if not _finite(self.latency_s) or self.latency_s < 0:
            raise ConfigError(f"Link(latency_s={self.latency_s!r}): must be seconds >= 0")
        if not _finite(self.bandwidth) or self.bandwidth <= 0:
            raise ConfigError(f"Link(bandwidth={self.bandwidth!r}): must be bytes/s > 0")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Workers packed ``per_node`` to a node: ``intra`` links inside a node (NVLink, shared
    memory, loopback), ``inter`` links between nodes (the node's network bandwidth; None
    on one node; ``per_node=None``: every replica on one node). ``algorithm``: "ring",
    "tree", "two_level" or "best" (the fastest of the three for each message, as NCCL's
    tuner picks)."""

    intra: Link
    inter: Link | None = None
    per_node: int | None = None
    algorithm: str = "best"

    def __post_init__(self) -> None:
        if self.per_node is None:
            pass
        elif isinstance(self.per_node, bool) or not isinstance(self.per_node, int):
            raise ConfigError(f"Topology(per_node={self.per_node!r}): must be an int >= 1")
        elif self.per_node < 1:
            raise ConfigError(f"Topology(per_node={self.per_node}): must be >= 1")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"Topology(algorithm={self.algorithm!r}): use one of {list(ALGORITHMS)}"
            )

    def nodes(self, replicas: int) -> int:
        return 1 if self.per_node is None else math.ceil(replicas / self.per_node)

    def local(self, replicas: int) -> int:
        """Replicas on one node."""
        return replicas if self.per_node is None else min(replicas, self.per_node)

    def _inter(self, replicas: int) -> Link:
        if self.nodes(replicas) > 1 and self.inter is None:
            raise ConfigError(
                f"{replicas} replicas at {self.per_node} per node span several nodes, but "
                "the topology has no inter-node link (a calibration on one node cannot "
                "measure one); give it the network between nodes: "
                "model.with_network(dataflow.costmodel.presets.interconnect('ib-hdr')), "
                "`dataflow scale --network ib-hdr`, or Topology(inter=Link(...))"
            )
        return self.inter or self.intra


def ring_seconds(nbytes: float, replicas: int, topology: Topology) -> float:
    """One ring allreduce of ``nbytes``: ``2 (W-1)`` steps, ``2 (nodes-1)`` of them between
    nodes; each rank moves ``2 (W-1)/W × nbytes`` at the slowest link's bandwidth."""
    w = replicas
    if w <= 1 or nbytes <= 0:
        return 0.0
    nodes = topology.nodes(w)
    steps, inter_steps = 2 * (w - 1), 2 * (nodes - 1)
    link = topology._inter(w)
    latency = (steps - inter_steps) * topology.intra.latency_s + inter_steps * link.latency_s
    bandwidth = (
        topology.intra.bandwidth if nodes == 1 else min(topology.intra.bandwidth, link.bandwidth)
    )
    return latency + 2 * (w - 1) / w * nbytes / bandwidth


def tree_seconds(nbytes: float, replicas: int, topology: Topology) -> float:
    """One tree allreduce: up and down ``per_node - 1`` hops inside a node and
    ``log2(nodes)`` between nodes; every byte crosses twice (half the bus bandwidth)."""
    w = replicas
    if w <= 1 or nbytes <= 0:
        return 0.0
    nodes = topology.nodes(w)
    local = topology.local(w)
    link = topology._inter(w)
    latency = 2 * ((local - 1) * topology.intra.latency_s + math.log2(nodes) * link.latency_s)
    bandwidth = (
        topology.intra.bandwidth if nodes == 1 else min(topology.intra.bandwidth, link.bandwidth)
    )
    return latency + 2 * nbytes / bandwidth


def two_level_seconds(nbytes: float, replicas: int, topology: Topology) -> float:
    """Reduce-scatter inside each node, a ring allreduce of each rank's ``1/per_node``
    share between nodes (all ranks of a node at once, sharing its network bandwidth),
    then all-gather inside the node (Horovod's hierarchical allreduce)."""
    w = replicas
    if w <= 1 or nbytes <= 0:
        return 0.0
    nodes = topology.nodes(w)
    local = topology.local(w)
    intra = topology.intra
    inside = 2 * (local - 1) * intra.latency_s + 2 * (local - 1) / local * nbytes / intra.bandwidth
    if nodes == 1:
        return inside
    link = topology._inter(w)
    between = 2 * (nodes - 1) * link.latency_s + 2 * (nodes - 1) / nodes * nbytes / link.bandwidth
    return inside + between


_BY_NAME = {"ring": ring_seconds, "tree": tree_seconds, "two_level": two_level_seconds}


def allreduce_seconds(
    nbytes: float, replicas: int, topology: Topology, algorithm: str | None = None
) -> float:
    """One allreduce of ``nbytes`` over ``replicas`` by ``algorithm`` (default: the
    topology's; "best" is the fastest of the three)."""
    name = algorithm or topology.algorithm
    if name == "best":
        return min(f(nbytes, replicas, topology) for f in _BY_NAME.values())
    if name not in _BY_NAME:
        raise ConfigError(f"algorithm={name!r}: use one of {list(ALGORITHMS)}")
    return _BY_NAME[name](nbytes, replicas, topology)


def bucket_sizes(total_bytes: int, bucket_bytes: int, first_bytes: int | None = None) -> list[int]:
    """How ``total_bytes`` of gradients split into buckets (the first one smaller, as in
    ``stages/buckets.py`` and DDP, so communication starts early in backward)."""
    if total_bytes <= 0:
        return []
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    sizes = []
    left = total_bytes
    if first_bytes is not None and first_bytes < bucket_bytes:
        sizes.append(min(first_bytes, left))
        left -= sizes[0]
    while left > 0:
        sizes.append(min(bucket_bytes, left))
        left -= sizes[-1]
    return sizes


def exposed_allreduce_seconds(
    buckets: list[int],
    replicas: int,
    topology: Topology,
    backward_s: float,
    overlap: float = 1.0,
) -> tuple[float, float]:
    """(total, exposed) seconds of the bucketed allreduces of one step.

    Bucket ``i`` is ready once backward has produced its bytes (gradients appear at an
    even rate over ``backward_s``); the buckets reduce one after another. What runs past
    the end of backward is exposed. ``overlap`` scales the backward time available to
    hide communication (1: fully concurrent, as NCCL on its own stream; 0: none).
    """
    total_bytes = sum(buckets)
    if replicas <= 1 or total_bytes <= 0:
        return 0.0, 0.0
    window = max(0.0, backward_s) * min(1.0, max(0.0, overlap))
    finish, produced, total = 0.0, 0, 0.0
    for size in buckets:
        produced += size
        ready = window * produced / total_bytes
        cost = allreduce_seconds(size, replicas, topology)
        total += cost
        finish = max(finish, ready) + cost
    return total, max(0.0, finish - window)


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
