"""Which gradients share an allreduce bucket (a pure function, like DDP's).

Parameters are taken in reverse registration order, the order in which backward
usually produces their gradients, so the first bucket fills (and its allreduce
starts) while backward is still computing the earlier layers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from dataflow.errors import ConfigError


def assign_buckets(
    nbytes: Sequence[int], keys: Sequence[Hashable], *, cap_bytes: int
) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes`` (one key per bucket).

    ``keys`` separates tensors that cannot share a flat buffer (dtype, device). A
    parameter larger than the cap gets a bucket of its own. Every index appears once.
    """
    if cap_bytes <= 0:
        raise ConfigError(f"bucket size must be > 0 bytes, got {cap_bytes}")
    if len(nbytes) != len(keys):
        raise ConfigError("assign_buckets: nbytes and keys need one entry per parameter")
    open_bucket: dict[Hashable, tuple[list[int], int]] = {}
    buckets: list[list[int]] = []
    for index in reversed(range(len(nbytes))):
        key = keys[index]
        members, size = open_bucket.get(key, ([], 0))
        if members and size + nbytes[index] > cap_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(index)
        open_bucket[key] = (members, size + nbytes[index])
    buckets.extend(members for members, _ in open_bucket.values() if members)
    return buckets
