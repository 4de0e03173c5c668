"""Data sources for the Load stage: in-memory arrays now, zarr stores next."""

from dataflow.io.array_source import ArraySource
from dataflow.io.prefetch import Prefetcher
from dataflow.io.sampler import epoch_order, steps_per_epoch

__all__ = ["ArraySource", "Prefetcher", "epoch_order", "steps_per_epoch"]
