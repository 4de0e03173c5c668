"""Copy a batch's rows out of a decoded chunk, with the GIL released.

The chunk reader assembles each batch on its own thread while the replica's thread
runs the step, which on a GPU is bound by the host (hundreds of kernel launches, each
giving up the GIL and taking it back). Before this module the assembly made one numpy
view per sample and joined them with ``concatenate``: Python work per sample, and a GIL
release and re-take per sample's copy. :func:`copy_rows` is one Numba call per chunk
and batch (``nogil``), moving whole rows as the widest unsigned words their size and
addresses allow: the assembly alone takes 2.6 ms a batch of 256 small-CNN samples
against 4.4 before on the 2-core development machine (``benchmarks/bench_loader_gil.py``,
which also measures what a host-bound step loses beside it). Arrays it cannot view so
(not C-contiguous, objects), and copies too small to be worth a call, take numpy's
fancy indexing instead. Indices are checked inside the kernel before anything is
written, so a bad one is an error, never a write out of bounds.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

_WORDS = (np.uint64, np.uint32, np.uint16, np.uint8)


@functools.cache
def _kernel() -> Any:
    """The compiled kernel, made on first use: importing this module loads no numba."""
    from numba import njit

    @njit(nogil=True, cache=True)
    def copy_rows_kernel(out, source, rows, positions):  # pragma: no cover - compiled
        n_out, n_source = out.shape[0], source.shape[0]
        for i in range(rows.shape[0]):  # every index checked before any write
            if rows[i] < 0 or rows[i] >= n_source or positions[i] < 0 or positions[i] >= n_out:
                return i
        for i in range(rows.shape[0]):
            out[positions[i], :] = source[rows[i], :]
        return -1

    return copy_rows_kernel


SMALL_COPY_BYTES = 64 * 2**10  # less is copied by numpy: faster than a kernel call, and brief


def _word(row_bytes: int, *arrays: np.ndarray) -> type:
    """The widest unsigned integer that divides a row and every array's address."""
    addresses = [a.__array_interface__["data"][0] for a in arrays]
    for word in _WORDS:
        size = np.dtype(word).itemsize
        if row_bytes % size == 0 and all(address % size == 0 for address in addresses):
            return word
    return np.uint8


def _plain(array: np.ndarray) -> bool:
    """Whether ``array`` is one C-contiguous block of plain data with samples first."""
    return (
        array.ndim > 0 and len(array) > 0 and array.flags.c_contiguous and not array.dtype.hasobject
    )


def copy_rows(out: np.ndarray, source: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> None:
    """``out[positions[i]] = source[rows[i]]`` for every ``i``: rows of a decoded chunk
    placed in a batch, with the GIL released where both arrays allow (module doc; under
    ``SMALL_COPY_BYTES`` in all, numpy copies). ``out`` and ``source`` have the same
    sample shape and dtype. An index out of range raises IndexError and writes nothing."""
    n = len(rows)
    if n != len(positions):
        raise ValueError(f"copy_rows: {n} rows but {len(positions)} positions")
    if out.dtype != source.dtype or out.shape[1:] != source.shape[1:]:
        raise ValueError(
            f"copy_rows: samples of {source.dtype} {source.shape[1:]} cannot go into a batch "
            f"of {out.dtype} {out.shape[1:]}"
        )
    row_bytes = source.dtype.itemsize * math.prod(source.shape[1:])
    if n * row_bytes < SMALL_COPY_BYTES or not (_plain(out) and _plain(source)):
        out[positions] = source[rows]  # numpy checks the indices itself
        return
    word = _word(row_bytes, out, source)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    bad = _kernel()(
        out.reshape(len(out), -1).view(word),
        source.reshape(len(source), -1).view(word),
        rows,
        positions,
    )
    if bad >= 0:
        raise IndexError(
            f"copy_rows: row {int(rows[bad])} of a chunk of {len(source)} samples to position "
            f"{int(positions[bad])} of a batch of {len(out)}: out of range, nothing was copied"
        )
