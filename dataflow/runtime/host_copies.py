"""Host copies of a replica's state (commits, rollbacks, checkpoints, joiners'
snapshots) that the host does not wait for, and the page-locked buffers window
commits reuse.

A window's commit copied ~1,000 tensors of ResNet-50 with its SGD momentum one blocking
device-to-host copy at a time, each a device sync: ~70 ms a window of host time on an
H200 (``benchmarks/probe_gpu_host.py``). Enqueued into page-locked memory on the
compute stream, they cost the host microseconds each; the stream's order keeps each
copy before any later kernel that changes its tensor (the next step's update), and a
reader waits for the copies' event first (``ReplicaState.settle``).

Page-locked memory from torch's caching host allocator is rounded up to a power of two
per allocation and stays cached: a commit per window would hold up to twice its state
in locked pages per live commit. :class:`HostArena` packs a commit's tensors into
fixed segments that the next commits reuse, so the replica holds its live commits'
bytes, not their powers of two.
"""

from __future__ import annotations

from typing import Any

import torch

# A commit's tensors are packed into segments of this size (a power of two: torch's
# page-locked allocator rounds every allocation up to one); a larger tensor has a
# buffer of its own, reused by the next commit that needs one at least as large.
SEGMENT_BYTES = 32 << 20
ALIGN_BYTES = 512  # each tensor's offset in a segment (any dtype's alignment)


def host_copy(value: Any, copies: HostCopies | None = None) -> Any:
    """A copy in host memory of nested dicts/lists of tensors (a state dict). With
    ``copies``, a CUDA tensor's copy is enqueued and not waited for (see HostCopies)."""
    if isinstance(value, torch.Tensor):
        if copies is not None:
            return copies.tensor(value)
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v, copies) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(host_copy(v, copies) for v in value)
    return value


def _dense(value: torch.Tensor) -> bool:
    """Whether ``value``'s strides describe a dense tensor a buffer of the same strides
    can mirror (contiguous, channels_last or channels_last_3d)."""
    formats = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
    return any(
        value.is_contiguous(memory_format=f)
        for f in formats
        if f == torch.contiguous_format or value.dim() == (4 if f == torch.channels_last else 5)
    )


class HostArena:
    """Reusable host buffers one commit's tensors are packed into.

    Page-locked where CUDA is available (the copies are enqueued into it), plain host
    memory elsewhere (the same packing, copied at once: what the CPU tests run).
    :meth:`reset` starts packing from the first segment again; the owner calls it
    only once the previous commit in it is dropped and its copies have ended."""

    def __init__(self, pinned: bool | None = None) -> None:
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.segments: list[torch.Tensor] = []
        self.large: list[torch.Tensor] = []  # buffers of tensors over SEGMENT_BYTES
        self.pending: Any = None  # the event after the last commit's copies into it
        self.reset()

    def reset(self) -> None:
        self._segment, self._offset, self._large_used = 0, 0, set()

    def ready(self) -> bool:
        """Whether the last copies into this arena have ended (so it may be reused)."""
        return self.pending is None or bool(self.pending.query())

    def _buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def _bytes_for(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the arena not handed out since :meth:`reset`."""
        if nbytes > SEGMENT_BYTES:  # the smallest free large buffer that holds it
            free = [
                (len(b), i)
                for i, b in enumerate(self.large)
                if i not in self._large_used and len(b) >= nbytes
            ]
            if free:
                index = min(free)[1]
            else:
                self.large.append(self._buffer(nbytes))
                index = len(self.large) - 1
            self._large_used.add(index)
            return self.large[index][:nbytes]
        if self._offset + nbytes > SEGMENT_BYTES:
            self._segment, self._offset = self._segment + 1, 0
        if self._segment == len(self.segments):
            self.segments.append(self._buffer(SEGMENT_BYTES))
        start = self._offset
        self._offset = -(-(start + nbytes) // ALIGN_BYTES) * ALIGN_BYTES
        return self.segments[self._segment][start : start + nbytes]

    def like(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor in the arena of ``value``'s shape, dtype and (dense) strides."""
        nbytes = value.numel() * value.element_size()
        flat = self._bytes_for(max(nbytes, value.element_size())).view(value.dtype)
        return flat[: value.numel()].as_strided(value.size(), value.stride())

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in (*self.segments, *self.large))


class HostCopies:
    """Host copies of device tensors that the host does not wait for.

    A dense CUDA tensor is copied into page-locked memory (``arena``'s, or a new
    buffer of torch's caching host allocator) on its device's current stream, and
    :meth:`done` returns an event after every copy. With an ``arena``, CPU tensors are
    packed into it too (copied at once). Anything else is copied at once, as before."""

    def __init__(self, arena: HostArena | None = None) -> None:
        self.arena = arena
        self.stream: torch.cuda.Stream | None = None

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach()
        cuda = value.device.type == "cuda"
        if not _dense(value) or (not cuda and self.arena is None):
            return value.to("cpu", copy=True)  # (a strided view: rare; copied at once)
        try:
            if self.arena is not None:
                host = self.arena.like(value)
            else:
                host = torch.empty_strided(
                    value.size(), value.stride(), dtype=value.dtype, pin_memory=True
                )
        except RuntimeError:  # page-locked memory refused: a blocking copy, as before
            return value.to("cpu", copy=True)
        host.copy_(value, non_blocking=cuda)
        if cuda:
            self.stream = torch.cuda.current_stream(value.device)
        return host

    def done(self) -> torch.cuda.Event | None:
        """An event after every enqueued copy (None: none was enqueued)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event
