"""Output buffers of batches, reused once nothing refers to them any more.

A fresh batch array costs a page fault per 4 KiB on first touch, about as much as
copying the samples into it, so the loaders (``io.chunk_reader``, ``io.array_readers``,
``io.stream``) take each batch's memory from a pool and hand a buffer out again only
when its reference count says nothing outside the pool holds it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import torch


def _refs(pool: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(pool[i])


_IDLE_REFS = _refs([np.empty(0)], 0)  # a buffer only its pool list refers to


class BatchBuffers:
    """Output buffers of batches, reused once nothing refers to them any more.

    A batch's arrays are views of a pooled numpy buffer (``torch.from_numpy``). Every
    object made from a batch's tensor (the tensor, a view, slice or reshape of it, its
    ``.numpy()``, its storage, a DLPack capsule) keeps a Python reference to that
    buffer, so the buffer is handed out again only when its reference count says the
    pool holds the last one: a consumer may keep any batch, or anything made from it,
    as long as it likes (``list(stream_batches(...))`` is fine). Only a raw pointer
    (``data_ptr()``) kept past the last reference is not protected. Buffers are never
    handed out twice at once, so this needs no rule about how far the consumer lags.

    The pool keeps at most ``keep`` buffers per (sample shape, dtype); when all are in
    use, a batch gets a plain new allocation that is not kept. A buffer serves batches
    of ``n`` samples when it holds between ``n`` and ``2 n``: varying per-replica shares
    reuse it, and a much smaller batch does not pin a much larger buffer.

    ``pin_memory=True`` (staging for CUDA): nothing is pooled here; each batch is a
    ``torch.empty(..., pin_memory=True)``, which torch's caching host allocator serves
    from pinned blocks it reuses (no new page-locking per batch) and hands out again
    only after the asynchronous copies that read a block have finished.
    """

    def __init__(self, keep: int = 6, *, pin_memory: bool = False) -> None:
        if keep < 0:
            raise ValueError(f"BatchBuffers(keep={keep}): must be >= 0")
        self.keep = keep
        self.pin_memory = pin_memory
        self.allocated = 0  # buffers allocated (fresh memory)
        self.reused = 0  # batches served from a pooled buffer
        self._pools: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, n: int, shape: tuple[int, ...], dtype: np.dtype) -> tuple[torch.Tensor, Any]:
        """A tensor of ``(n, *shape)`` samples, and a numpy view of it to write the batch in."""
        if self.pin_memory:
            tensor = torch.from_numpy(np.empty(0, dtype))  # the torch dtype of ``dtype``
            tensor = torch.empty((n, *shape), dtype=tensor.dtype, pin_memory=True)
            self.allocated += 1
            return tensor, tensor.numpy()
        view = self.take_array(n, shape, dtype)
        return torch.from_numpy(view), view

    def take_array(self, n: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A numpy array of ``(n, *shape)`` from the pool (never pinned)."""
        key = (tuple(shape), np.dtype(dtype))
        with self._lock:
            pool = self._pools.setdefault(key, [])
            best, spare = -1, -1
            for i in range(len(pool)):
                if _refs(pool, i) != _IDLE_REFS:
                    continue  # in use: some batch, view or array still refers to it
                rows = len(pool[i])
                if n <= rows <= 2 * n and (best < 0 or rows < len(pool[best])):
                    best = i
                spare = i
            if best >= 0:
                self.reused += 1
                buffer = pool[best]
            else:
                buffer = np.empty((n, *shape), dtype)
                self.allocated += 1
                if len(pool) < self.keep:
                    pool.append(buffer)
                elif spare >= 0:  # an idle buffer of the wrong size makes room
                    pool[spare] = buffer
        return buffer[:n]
