"""The box a streamed copy of a zarr array (``tools.rechunk``) reads and writes at once:
aligned to the destination's chunks (each written once, whole) and, within a memory
budget, to the source's (each decoded once). Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence


def slab_shape(
    shape: Sequence[int],
    src_chunks: Sequence[int],
    dst_chunks: Sequence[int],
    itemsize: int,
    budget: int,
) -> tuple[int, ...]:
    """The box copied at once: a multiple of ``dst_chunks`` along every axis (each
    destination chunk written once, whole) and, where it fits within ``budget`` bytes, of
    ``src_chunks`` too (each source chunk decoded once). Over the budget, one axis is cut
    to the longest multiple of its destination chunk that fits, the axis whose source
    chunks are then decoded the fewest times; then the box grows, first axis first,
    while it fits. At least one destination chunk, whatever the budget."""
    dst = [min(d, s) for d, s in zip(dst_chunks, shape, strict=True)]
    unit = [
        s if math.lcm(a, b) >= s else math.lcm(a, b)
        for s, a, b in zip(shape, src_chunks, dst, strict=True)
    ]

    def size() -> int:
        return math.prod(unit) * itemsize

    while size() > budget:
        options = []  # (times a source chunk is decoded, -bytes, axis, length)
        for i in (i for i in range(len(shape)) if unit[i] > dst[i]):
            fits = unit[i] * budget // size() // dst[i] * dst[i]
            length = max(dst[i], min(fits, unit[i] - dst[i]))
            decodes = math.ceil(src_chunks[i] / length) + (length % src_chunks[i] != 0)
            cut = size() // unit[i] * length
            options.append((cut > budget, decodes, -cut, i, length))
        if not options:
            break
        *_, i, length = min(options)
        unit[i] = length
    for i in range(len(shape)):
        times = budget // max(size(), 1)
        if times <= 1:
            break
        unit[i] = min(shape[i], unit[i] * times)
    return tuple(unit)
