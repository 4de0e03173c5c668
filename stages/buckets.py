"""Which gradients share an allreduce bucket (a pure function, like DDP's).

Parameters are taken in reverse registration order, the order in which backward
usually produces their gradients, so the first bucket fills (and its allreduce
starts) while backward is still computing the earlier layers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from dataflow.core.errors import ConfigError

FIRST_BUCKET_BYTES = 1 << 20  # as DDP: the first bucket's allreduce starts early in backward


def assign_buckets(
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    *,
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes`` (one key per bucket).

    The first bucket of each key holds at most ``first_cap_bytes`` (default: the
    smaller of ``cap_bytes`` and 1 MiB), so that even a model whose gradients fit in
    one bucket overlaps communication with backward. ``keys`` separates tensors that
    cannot share a flat buffer (dtype, device). A parameter larger than the cap gets
    a bucket of its own. Every index appears once.
    """
    if cap_bytes <= 0:
        raise ConfigError(f"bucket size must be > 0 bytes, got {cap_bytes}")
    first_cap = min(cap_bytes, FIRST_BUCKET_BYTES if first_cap_bytes is None else first_cap_bytes)
    started: set[Hashable] = set()  # keys whose first bucket is closed
    if len(nbytes) != len(keys):
        raise ConfigError("assign_buckets: nbytes and keys need one entry per parameter")
    open_bucket: dict[Hashable, tuple[list[int], int]] = {}
    buckets: list[list[int]] = []
    for index in reversed(range(len(nbytes))):
        key = keys[index]
        members, size = open_bucket.get(key, ([], 0))
        cap = cap_bytes if key in started else first_cap
        if members and size + nbytes[index] > cap:
            buckets.append(members)
            started.add(key)
            members, size = [], 0
        members.append(index)
        open_bucket[key] = (members, size + nbytes[index])
    buckets.extend(members for members, _ in open_bucket.values() if members)
    return buckets
