"""Which samples each step reads: a pure function of (seed, epoch, step, split).

Every replica computes its own indices from the same inputs, so no index lists
travel over the network, and a single process that walks the same global batches
(``epoch_order(...)[spec.start : spec.start + spec.global_batch]``) trains on
exactly the same data: the basis of the equivalence and every-sample-once tests.
"""

from __future__ import annotations

import numpy as np


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order in which an epoch visits the samples (int64 indices)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    return rng.permutation(num_samples).astype(np.int64, copy=False)


def steps_per_epoch(num_samples: int, global_batch: int, *, drop_last: bool) -> int:
    """Steps in one epoch: a short last step is kept unless ``drop_last``."""
    full, rest = divmod(num_samples, global_batch)
    return full if drop_last or rest == 0 else full + 1
