"""Keep glibc from returning every freed tensor to the OS in Dask worker processes.

Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536`` so that workers
holding many small arrays give memory back. Setting that variable also turns off
glibc's dynamic mmap threshold, so every allocation over 128 KiB (every activation
and gradient of a CNN) becomes a fresh ``mmap`` of zeroed pages, faulted in 4 KiB at
a time and unmapped when freed. On CPU that made training steps 1.7-2.3x slower
than the same loop outside Dask (benchmarks/bench_overhead.py). A replica's memory
is reused step after step, so the right policy for it is the opposite one.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum: allocations below it come from the heap
TRIM_THRESHOLD_BYTES = 256 << 20  # give memory back only when this much is free at the top

ENV_VARIABLE = "MALLOC_TRIM_THRESHOLD_"


def relax_malloc() -> bool:
    """Serve tensor-sized allocations from the heap and trim rarely; False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to undo
        return False
    return (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )


def needs_relaxing() -> bool:
    """True when the process was started with the trim variable (Dask's default)."""
    return ENV_VARIABLE in os.environ
