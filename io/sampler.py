"""How many steps an epoch has (which samples each step reads: ``io.sharding``)."""

from __future__ import annotations


def steps_per_epoch(num_samples: int, global_batch: int, *, drop_last: bool) -> int:
    """Steps in one epoch: a short last step is kept unless ``drop_last``."""
    full, rest = divmod(num_samples, global_batch)
    return full if drop_last or rest == 0 else full + 1
