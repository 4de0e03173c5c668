"""Which parameters each parameter-store shard holds (a pure function).

Shards hold whole parameters, consecutive in the model's order, so a shard's part of
the flat parameter vector is one contiguous range; the cut balances elements.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from dataflow.core.errors import ConfigError


def shard_ranges(sizes: Sequence[int], shards: int) -> list[range]:
    """Parameter indices per shard: ``shards`` consecutive runs of ``sizes`` (elements
    per parameter) with near-equal element counts, none empty."""
    if shards < 1:
        raise ConfigError(f"parameter store: shards must be >= 1, got {shards}")
    if shards > len(sizes):
        raise ConfigError(
            f"sync.Async(servers={shards}): the model has only {len(sizes)} parameter "
            f"tensors; use servers <= {len(sizes)}"
        )
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts = [0]
    for k in range(1, shards):
        target = prefix[-1] * k / shards
        # the cut nearest the target that leaves at least one parameter on every side
        low, high = cuts[-1] + 1, len(sizes) - (shards - k)
        cuts.append(min(range(low, high + 1), key=lambda i: (abs(prefix[i] - target), i)))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]
