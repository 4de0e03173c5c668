"""How the parameter store's messages travel on its data plane: one frame per message.

A message is a dict of plain values and tensors (a push's gradient, a reply's weights,
a window's optimizer state). It is pickled with protocol 5 and every CPU tensor's bytes
go *out of band*: the frame carries them as separate buffers, written from the
tensor's memory and read into fresh buffers the tensors are rebuilt on, with no copy
through the pickle stream. Layout (all lengths little-endian unsigned 64-bit)::

    [header length][buffer count n][n buffer lengths][pickled header][buffer 0]...[n-1]

A reader takes the first 16 bytes, then the lengths and the header in one read, then
each buffer.

A tensor numpy cannot hold (bfloat16) or one on a GPU travels in band, as torch
pickles it; the store only sends CPU float tensors, so that path is a fallback.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import numpy as np
import torch

_PREFIX = struct.Struct("<QQ")  # the header's length, the buffer count
PREFIX_BYTES = _PREFIX.size
# a frame whose header says more than this is not one of ours (a stray connection)
MAX_BUFFERS = 1 << 16
MAX_HEADER_BYTES = 1 << 30


def _tensor_from_array(array: np.ndarray, requires_grad: bool) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.requires_grad_() if requires_grad else tensor


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor  # (a Parameter, a subclass: as torch pickles it)
            and obj.device.type == "cpu"
            and obj.dtype != torch.bfloat16
            and obj.layout == torch.strided
        ):
            array = obj.detach().contiguous().numpy()
            return _tensor_from_array, (array, bool(obj.requires_grad))
        return NotImplemented


def encode(message: Any) -> list[memoryview | bytes]:
    """The frame of ``message`` as pieces to write in order: the lengths, the header,
    the buffers (one ``sendmsg`` writes them all for a small message)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(message)
    header = stream.getbuffer()
    raws = [b.raw() for b in buffers]
    lengths = struct.pack(f"<QQ{len(raws)}Q", len(header), len(raws), *(r.nbytes for r in raws))
    return [lengths, header, *raws]


def decode(header: Any, buffers: list[Any]) -> Any:
    return pickle.loads(header, buffers=buffers)


def frame_prefix(prefix: bytes | memoryview) -> tuple[int, int]:
    """The header's length and the buffer count, from a frame's first ``PREFIX_BYTES``."""
    header_bytes, count = _PREFIX.unpack(prefix)
    if header_bytes > MAX_HEADER_BYTES or count > MAX_BUFFERS:
        raise ValueError(
            f"not a parameter-store frame (header {header_bytes} bytes, {count} buffers)"
        )
    return header_bytes, count


def buffer_sizes(block: bytes | memoryview, count: int) -> list[int]:
    """The buffers' lengths: the ``8 * count`` bytes after the prefix."""
    return list(struct.unpack(f"<{count}Q", block[: 8 * count]))
