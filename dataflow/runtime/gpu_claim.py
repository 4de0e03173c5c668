"""Which GPU a worker process trains on: one of its own, held for the process's life.

A worker that sees several GPUs (a node's workers under ``mpirun`` without a GPU per
rank, a dask-jobqueue job of ``--nworkers 4`` on a whole node, dask-cuda's
``LocalCUDACluster``, which shows every worker all GPUs with its own first, a
``LocalCluster`` on a multi-GPU workstation) takes the first GPU, in the order this
process sees them, that no other worker process of this user on this host holds. It
holds an exclusive ``flock`` on a file named for the GPU's UUID, so workers that order
their GPUs differently still agree; the kernel drops the lock when the process dies, so
a worker a nanny restarts after a loss takes the GPU its predecessor freed, whatever
rank the regrouped fit gives it. With more workers than GPUs they share them evenly (a
second lock file per GPU, then a third, ...).

The rule before, replica rank modulo the GPUs seen, put two replicas on one GPU after a
regroup (a survivor keeps its GPU, its rank moves, a joiner gets the survivor's old
rank) and under dask-cuda's rotated device lists; NCCL refuses two ranks on one GPU,
so the whole group fell back to gloo through host memory.

Where no lock can be taken (no ``fcntl``, a file system without ``flock``, a directory
that cannot be written) the caller falls back to that rule.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # not on Windows: no claims, the rank rule
    fcntl = None  # type: ignore[assignment]

LOCK_DIR_ENV = "DATAFLOW_GPU_LOCK_DIR"
# more workers than this on one GPU: no claim, the rank rule (nobody trains that way)
MAX_SHARERS = 64
CLAIM_ATTEMPTS = 16

__all__ = [
    "LOCK_DIR_ENV",
    "GpuClaim",
    "choose_gpu",
    "claim_gpu",
    "free_slot",
    "lock_directory",
    "visible_gpu_ids",
]


@dataclass
class GpuClaim:
    """A worker's GPU: ``index`` in this process's CUDA numbering, ``sharers`` how many
    other worker processes held it when this one took it (0: its own)."""

    index: int
    sharers: int
    lock: IO[str] | None = None  # open while the claim lasts

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # closing the file drops its flock
            self.lock = None


def choose_gpu(holders: Sequence[int]) -> int:
    """The GPU a new claim takes, given how many workers hold each (this process's
    order): the least held, the first of those. Pure."""
    return min(range(len(holders)), key=lambda index: (holders[index], index))


def free_slot(held: set[int]) -> int:
    """The lowest slot (lock file) of a GPU that no worker holds. Pure."""
    return next(slot for slot in range(len(held) + 1) if slot not in held)


def lock_directory() -> Path:
    """Where the claims' lock files live: ``$DATAFLOW_GPU_LOCK_DIR``, else a folder of
    this user's in ``/dev/shm`` (node-local memory, one per host, whatever ``$TMPDIR``
    each batch job was given), else in the temporary directory."""
    chosen = os.environ.get(LOCK_DIR_ENV)
    if chosen:
        return Path(chosen)
    shared = Path("/dev/shm")
    base = shared if shared.is_dir() and os.access(shared, os.W_OK) else None
    return Path(base or tempfile.gettempdir()) / f"dataflow-gpus-{os.getuid()}"


def claim_gpu(gpu_ids: Sequence[str], directory: Path | None = None) -> GpuClaim | None:
    """Take the GPU of ``gpu_ids`` (this process's order; each a host-wide name, e.g.
    the UUID) that the fewest other claims hold, the first of those; ``None`` where no
    lock can be taken. The claim lasts until :meth:`GpuClaim.release` or the process's
    end."""
    if fcntl is None or not gpu_ids:
        return None
    directory = lock_directory() if directory is None else directory
    names = [_file_name(gpu_id) for gpu_id in gpu_ids]
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for _ in range(CLAIM_ATTEMPTS):  # another worker may take the slot meanwhile
            held = [_held_slots(directory, name) for name in names]
            index = choose_gpu([len(slots) for slots in held])
            if len(held[index]) >= MAX_SHARERS:
                return None
            slot = free_slot(held[index])
            handle = _try_lock(directory / f"{names[index]}.{slot}.lock")
            if handle is not None:
                with contextlib.suppress(OSError):  # who holds it, for a person looking
                    handle.seek(0)
                    handle.truncate()
                    handle.write(f"{os.getpid()}\n")
                    handle.flush()
                return GpuClaim(index, len(held[index]), handle)
    except OSError:  # a directory that cannot be written, a file system without flock
        return None
    return None


def _held_slots(directory: Path, name: str) -> set[int]:
    """The slots of GPU ``name`` some process holds now (a lock file whose lock is
    taken; a file left by a process that died is free)."""
    held = set()
    for path in directory.glob(f"{name}.*.lock"):
        slot = path.name[len(name) + 1 : -len(".lock")]
        if not slot.isdigit():
            continue
        handle = _try_lock(path)
        if handle is None:
            held.add(int(slot))
        else:
            handle.close()
    return held


def _try_lock(path: Path) -> IO[str] | None:
    """``path`` opened and exclusively locked, or ``None`` when another process holds
    it. Other errors (no flock here) are raised."""
    handle = open(path, "a+")  # noqa: SIM115 (held open: the claim lasts as long)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    except OSError:
        handle.close()
        raise
    return handle


def visible_gpu_ids() -> list[str]:
    """A host-wide name for each GPU this process sees, in its CUDA order: the UUID
    (the same GPU has the same UUID whatever ``CUDA_VISIBLE_DEVICES`` calls it)."""
    import torch

    ids = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        ids.append(str(uuid) if uuid is not None else f"{props.name}-{index}")
    return ids


class ClaimOnce:
    """A worker's claim, taken on first use and kept (the worker plugin holds one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = False
        self.claim: GpuClaim | None = None

    def get(self, gpu_ids: Sequence[str] | None = None) -> GpuClaim | None:
        with self._lock:
            if not self._taken:
                self._taken = True
                self.claim = claim_gpu(visible_gpu_ids() if gpu_ids is None else gpu_ids)
            return self.claim

    def release(self) -> None:
        with self._lock:
            if self.claim is not None:
                self.claim.release()
            self.claim, self._taken = None, False


def _file_name(gpu_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", gpu_id)
