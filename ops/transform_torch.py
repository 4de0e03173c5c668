"""RandomFlip and RandomRotate90 on CUDA tensors: a few batch-wide torch calls.

Their Numba CUDA kernels lost to torch on an H100 (``benchmarks/bench_gpu.py``, best
torch time / ours on 32 x 1 x 64^3 float32, >1 when ours is faster): RandomFlip(2, 3, 4)
0.78, 0.83, 0.81 against a per-sample ``flip`` loop on 2026-11-26 (0.79, 0.90 on
11-24), RandomRotate90(3, 4) 0.56, 0.39, 0.52 against a per-sample ``rot90`` loop (0.49,
0.54). Launching a Numba kernel from Python (about 0.25 ms) costs more than moving one
such batch, so the kernels were removed and these functions run instead (the op's
``torch_cuda``, see ``ops/registry.py``); on the CPU the Numba kernels stay.

Each function takes its CPU kernel's arguments (``transform_kernels.flip_cpu`` /
``rot90_cpu``) as tensors, with the choices the op drew on the host from (seed, step,
replica), and writes ``out``, cast included. They only move elements and cast them as
torch does, so on CPU tensors they equal the CPU kernels bit for bit: that is how they
are tested without a GPU (``tests/test_ops_torch_paths.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _on(device: torch.device, table: np.ndarray) -> torch.Tensor:
    """A small host table on ``device``, copied through pinned memory without making the
    host wait for the GPU."""
    t = torch.from_numpy(np.ascontiguousarray(table))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def flip_torch(x: torch.Tensor, out: torch.Tensor, *, flags: Any) -> None:
    """``x``, ``out`` as [N, C, D, H, W]; ``flags[n]``: flip D, H, W of sample n.

    Per axis: flipped in every sample, one ``flip``; in some, ``torch.where(mask,
    y.flip(axis), y)``; in none, nothing. At most 3 flips and 3 selects, whatever N.
    """
    flags = np.asarray(flags, dtype=bool)
    mask = None
    y = x
    for i in range(3):
        if flags[:, i].all():
            y = y.flip(2 + i)
        elif flags[:, i].any():
            if mask is None:
                mask = _on(x.device, flags).view(-1, 3, 1, 1, 1)
            y = torch.where(mask[:, i : i + 1], y.flip(2 + i), y)
    out.copy_(y)


def rot90_torch(x: torch.Tensor, out: torch.Tensor, *, ks: Any) -> None:
    """``x``, ``out`` as [N, C, L, P, M, Q, R]; sample n turned by ``ks[n]`` quarter turns
    in the (P, Q) plane, from P towards Q (``torch.rot90(., k, (3, 5))``).

    Samples are grouped by k: one ``rot90`` per group present (at most 4), gathered with
    ``index_select`` and written back with ``index_copy_``; one group, one ``rot90``.
    """
    ks = np.asarray(ks, dtype=np.int64)
    counts = np.bincount(ks, minlength=4)
    if np.count_nonzero(counts) <= 1:
        k = int(ks[0]) if ks.size else 0
        out.copy_(torch.rot90(x, k, (3, 5)) if k else x)
        return
    index = _on(x.device, np.argsort(ks, kind="stable"))
    start = 0
    for k, count in enumerate(counts.tolist()):
        if not count:
            continue
        picked = index[start : start + count]
        start += count
        part = x.index_select(0, picked)
        if k:
            part = torch.rot90(part, k, (3, 5))
        out.index_copy_(0, picked, part.to(out.dtype))
