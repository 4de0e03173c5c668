"""Where each spatial rank's region lies, and which rows it must fetch from whom.

Pure integer arithmetic (no torch): the partitioned layers, the zarr region reads and
the layout model all ask the same questions here, so they agree by construction.

A tensor's partition along a split dimension depends only on its global extent and the
group's split weights (:func:`split_extent`): two tensors of the same extent are split
alike, so a residual ``x + f(x)`` adds matching regions whatever ``f`` did in between.
A windowed layer (convolution, pooling) computes the outputs its rank owns; the input
rows those need but another rank owns arrive as a halo (:func:`exchange`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Interval = tuple[int, int]  # [lo, hi) along one dimension


def split_extent(
    extent: int, parts: int, weights: Sequence[float] | None = None
) -> tuple[Interval, ...]:
    """``extent`` rows cut into ``parts`` contiguous intervals, in proportion to
    ``weights`` (equal by default), boundaries rounded half up; some may be empty."""
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    if weights is None:
        weights = (1.0,) * parts
    if len(weights) != parts or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"weights={tuple(weights)} must be {parts} non-negative numbers, not all 0"
        )
    total, acc, bounds = float(sum(weights)), 0.0, [0]
    for w in weights[:-1]:
        acc += w
        bounds.append(min(extent, int(extent * acc / total + 0.5)))
    bounds.append(extent)
    return tuple((bounds[i], bounds[i + 1]) for i in range(parts))


def grid_shape(parts: int, dims: int) -> tuple[int, ...]:
    """``parts`` ranks as a grid over ``dims`` dimensions, as square as it goes (the
    larger factors first): 4 over 2 dims is (2, 2), 8 over 2 is (4, 2), 6 over 3 is (3, 2, 1)."""
    if parts < 1 or dims < 1:
        raise ValueError(f"parts={parts} and dims={dims} must be >= 1")
    primes, n, f = [], parts, 2
    while n > 1:
        while n % f == 0:
            primes.append(f)
            n //= f
        f += 1
    grid = [1] * dims
    for p in sorted(primes, reverse=True):
        grid[grid.index(min(grid))] *= p
    return tuple(sorted(grid, reverse=True))


def coords_of(rank: int, grid: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of ``rank`` in ``grid``."""
    out = []
    for size in reversed(grid):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def rank_of(coords: Sequence[int], grid: Sequence[int]) -> int:
    rank = 0
    for c, size in zip(coords, grid, strict=True):
        rank = rank * size + c
    return rank


@dataclass(frozen=True)
class Window:
    """A sliding window along one dimension: convolution or pooling."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    ceil_mode: bool = False  # pooling only

    @property
    def span(self) -> int:
        """Input rows one output reads."""
        return self.dilation * (self.kernel - 1) + 1

    def out_extent(self, extent: int) -> int:
        """Torch's output size for an input of ``extent`` rows."""
        room = extent + self.pad_lo + self.pad_hi - self.span
        if room < 0:
            return 0
        if not self.ceil_mode:
            return room // self.stride + 1
        out = -(-room // self.stride) + 1
        if (out - 1) * self.stride >= extent + self.pad_lo:
            out -= 1  # torch: the last window must start inside the input or left padding
        return out

    def needed(self, out: Interval) -> Interval:
        """Input rows (unclipped: negative or past the end means padding) that outputs
        ``out`` read."""
        lo, hi = out
        if hi <= lo:
            start = lo * self.stride - self.pad_lo
            return start, start
        return lo * self.stride - self.pad_lo, (hi - 1) * self.stride - self.pad_lo + self.span

    def inside(self, own: Interval) -> Interval:
        """The outputs whose rows all lie in ``own`` (no halo, no padding): what a rank
        computes from its own rows, without a copy, while its halo is in flight."""
        first = -((own[0] + self.pad_lo) // -self.stride)  # ceil
        last = (own[1] + self.pad_lo - self.span) // self.stride  # floor, inclusive
        return max(0, first), max(max(0, first), last + 1)


def clip(rows: Interval, extent: int) -> Interval:
    return max(0, rows[0]), max(max(0, rows[0]), min(extent, rows[1]))


def overlap(a: Interval, b: Interval) -> Interval | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else None


@dataclass(frozen=True)
class Exchange:
    """One rank's halo traffic along one dimension: the rows it sends to and receives
    from each peer (by coordinate along the dimension), in global indices."""

    sends: tuple[tuple[int, Interval], ...]
    recvs: tuple[tuple[int, Interval], ...]

    @property
    def empty(self) -> bool:
        return not self.sends and not self.recvs


def exchange(me: int, owned: Sequence[Interval], needs: Sequence[Interval]) -> Exchange:
    """Rank ``me``'s traffic when rank ``q`` owns ``owned[q]`` and needs ``needs[q]``
    (clipped to the extent)."""
    sends, recvs = [], []
    for q in range(len(owned)):
        if q == me:
            continue
        if (rows := overlap(needs[q], owned[me])) is not None:
            sends.append((q, rows))
        if (rows := overlap(needs[me], owned[q])) is not None:
            recvs.append((q, rows))
    return Exchange(tuple(sends), tuple(recvs))


def halo_rows(windows_and_extents: Sequence[tuple[Window, int]], parts: int) -> int:
    """Rows received in all by the ``parts`` ranks over a chain of windowed layers along
    one split dimension (for the layout model)."""
    total = 0
    for window, extent in windows_and_extents:
        owned = split_extent(extent, parts)
        outs = split_extent(window.out_extent(extent), parts)
        needs = [clip(window.needed(o), extent) for o in outs]
        for me in range(parts):
            total += sum(hi - lo for _, (lo, hi) in exchange(me, owned, needs).recvs)
    return total
