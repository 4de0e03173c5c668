"""How well a shuffled window epoch mixes its batches (pure, milliseconds).

A shuffled ``PatchSource`` epoch reads blocks of storage chunks (``io.windows``
``block_units``) kept in super-blocks of ``2 ** d`` neighbours (``block_groups``) and
permutes windows within ``buffer_chunks`` blocks (``io.sharding``): the batches mix
windows of a few neighbouring blocks, where a full random permutation (the same windows
pre-cut into an ``ArraySource(shuffle=True)``) mixes windows from all over the array.
This module measures that, per global batch, over the orders the engine itself would
produce (``io.sharding.replica_epochs``, as ``stages.Load`` calls it; nothing here
re-implements the shuffle):

- ``units``: distinct blocks (read units) per batch;
- ``groups``: distinct super-blocks per batch;
- ``spread``: the mean pairwise distance between the batch's window corners (L1, in
  cells along the patch dims), over that of two windows drawn at random from the whole
  array (exact): about 1 for a uniformly random batch, near 0 for a batch of neighbours;
- ``trend``: how closely the batches' place in the array follows their place in the
  epoch (the largest, over patch dims, absolute correlation between the step and the
  batch's mean corner): about 1 when the epoch sweeps the array (C order: a row of
  windows may cross many blocks, yet every step trains on the region after the last),
  near 0 when the regions come in a random order.

The orders compared: ``shuffle=False`` (C order), the shuffled epoch at each
``buffer_chunks``, and the full permutation (the reference). Each batch is labelled by
the shuffled source's blocks and super-blocks, whatever the order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dataflow.core.errors import ConfigError
from dataflow.core.step import StepSpec
from dataflow.io.sharding import replica_epochs, source_chunk_groups, source_chunk_members

DEFAULT_BUFFER_CHOICES = (1, 4, 16)


@dataclass(frozen=True)
class Mixing:
    """One order's mixing, averaged over its full global batches."""

    order: str  # "shuffle=False", "buffer_chunks=4", "full permutation"
    buffer_chunks: int | None  # None for C order and the full permutation
    batches: int
    units_mean: float  # distinct blocks per batch
    units_min: int
    groups_mean: float  # distinct super-blocks per batch
    spread: float  # mean pairwise corner distance in a batch / that of random windows
    trend: float  # |correlation| of a batch's step in the epoch with its mean corner


def split_batch(batch_size: int, replicas: int) -> tuple[int, ...]:
    """Local batches of equal replicas: ``batch_size`` dealt out as evenly as it goes."""
    base, extra = divmod(batch_size, replicas)
    return tuple(base + (r < extra) for r in range(replicas))


def epoch_steps(num_samples: int, batch_size: int, replicas: int, epochs: int) -> list[StepSpec]:
    """Every full global batch of ``epochs`` epochs as the planner's steps (the last,
    short batch of an epoch left out, so every batch is comparable)."""
    local = split_batch(batch_size, replicas)
    per_epoch = num_samples // batch_size
    return [
        StepSpec(
            index=e * per_epoch + k,
            epoch=e,
            step_in_epoch=k,
            start=k * batch_size,
            global_batch=batch_size,
            local_batches=local,
            last_in_epoch=k == per_epoch - 1,
        )
        for e in range(epochs)
        for k in range(per_epoch)
    ]


def engine_batches(
    steps: Sequence[StepSpec],
    *,
    sizes: Sequence[int],
    seed: int,
    shuffle: bool,
    buffer_chunks: int = 1,
    members: Sequence[np.ndarray] | None = None,
    groups: Sequence[int] | None = None,
) -> list[list[np.ndarray]]:
    """Per epoch, each step's global batch (every replica's share, in replica order), as
    the engine orders the epoch (``io.sharding.replica_epochs``)."""
    epochs = []
    for _, _, parts in replica_epochs(
        steps,
        sizes=sizes,
        seed=seed,
        shuffle=shuffle,
        buffer_chunks=buffer_chunks,
        members=members,
        groups=groups,
    ):
        epochs.append([np.concatenate(step_parts) for step_parts in parts])
    return epochs


def mean_pairwise_distance(corners: np.ndarray) -> float:
    """Mean L1 distance over the distinct pairs of ``corners`` (exact: per dim, the sorted
    values weighted by ``2k - n + 1``; no pair loop). 0 for fewer than two."""
    return float(batch_distances(np.asarray(corners)[None])[0])


def batch_distances(corners: np.ndarray) -> np.ndarray:
    """Per batch of ``corners`` ``(batches, size, d)``, the mean L1 distance over its
    distinct pairs, vectorised over batches; 0 for batches of fewer than two."""
    k, n = corners.shape[:2]
    if n < 2:
        return np.zeros(k)
    ranked = np.sort(np.asarray(corners, dtype=np.float64).reshape(k, n, -1), axis=1)
    weights = 2 * np.arange(n, dtype=np.float64) - n + 1
    return np.einsum("n,knd->k", weights, ranked) / (n * (n - 1) / 2)


def distinct(labels: np.ndarray) -> np.ndarray:
    """Distinct values per row of ``labels`` ``(batches, size)``."""
    ranked = np.sort(labels, axis=1)
    return 1 + (np.diff(ranked, axis=1) != 0).sum(axis=1)


def step_trend(centroids: np.ndarray) -> float:
    """The largest absolute correlation, over dims, between the step and ``centroids``
    (one row per step); a dim that does not move counts 0."""
    if len(centroids) < 2:
        return 0.0
    steps = np.arange(len(centroids), dtype=np.float64)
    steps -= steps.mean()
    moved = centroids - centroids.mean(axis=0)
    scale = np.sqrt((moved**2).sum(axis=0) * (steps**2).sum())
    corr = np.abs(steps @ moved) / np.where(scale > 0, scale, 1.0)
    return float(corr.max(initial=0.0))


def measure(
    name: str,
    epochs: Sequence[Sequence[np.ndarray]],
    unit_of: np.ndarray,
    group_of: np.ndarray,
    corners: np.ndarray,
    reference: float,
    buffer_chunks: int | None = None,
) -> Mixing:
    """The mixing of each epoch's batches (sample indices, of one size) given each
    sample's block, super-block and corner, against ``reference`` (the whole array's mean
    pairwise distance); ``trend`` is averaged over the epochs. No loop over batches."""
    batches = np.stack([b for epoch in epochs for b in epoch])
    units = distinct(unit_of[batches])
    at = corners[batches].astype(np.float64)
    per_epoch = [len(e) for e in epochs]
    centroids = np.split(at.mean(axis=1), np.cumsum(per_epoch)[:-1])
    trend = [step_trend(c) for c in centroids if len(c)]
    return Mixing(
        order=name,
        buffer_chunks=buffer_chunks,
        batches=len(batches),
        units_mean=float(units.mean()),
        units_min=int(units.min()),
        groups_mean=float(distinct(group_of[batches]).mean()),
        spread=float(batch_distances(at).mean() / reference) if reference > 0 else 1.0,
        trend=float(np.mean(trend)) if trend else 0.0,
    )


def window_mixing(
    corners: np.ndarray,
    members: Sequence[np.ndarray],
    groups: Sequence[int],
    batch_size: int,
    *,
    buffer_chunks: Sequence[int] = DEFAULT_BUFFER_CHOICES,
    replicas: int = 1,
    seed: int = 0,
    epochs: int = 1,
) -> list[Mixing]:
    """C order, the shuffled epoch at each of ``buffer_chunks`` and the full permutation,
    for windows at ``corners`` read in the blocks ``members`` (sample indices per block)
    kept in the super-blocks ``groups`` (one id per block), ``replicas`` equal replicas
    sharing each global batch of ``batch_size``, over ``epochs`` epochs of ``seed``."""
    corners = np.asarray(corners, dtype=np.int64).reshape(len(corners), -1)
    n = len(corners)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ConfigError(
            f"mixing(batch_size={batch_size!r}): the global batch must be an int in 1..{n} "
            "(the windows the source holds)"
        )
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"mixing(replicas={replicas!r}): an int >= 1 (the fit's replicas)")
    if len(groups) != len(members):
        raise ConfigError(
            f"mixing: {len(groups)} super-block ids for {len(members)} blocks; give one per block"
        )
    unit_of = np.empty(n, dtype=np.int64)
    for u, m in enumerate(members):
        unit_of[np.asarray(m, dtype=np.int64)] = u
    group_of = np.asarray(groups, dtype=np.int64)[unit_of]
    reference = mean_pairwise_distance(corners)
    steps = epoch_steps(n, batch_size, replicas, epochs)
    sizes = [len(m) for m in members]
    ones = [1] * n  # an ArraySource: one sample per chunk

    def row(name: str, batches: list[list[np.ndarray]], buffer: int | None = None) -> Mixing:
        return measure(name, batches, unit_of, group_of, corners, reference, buffer)

    rows = [row("shuffle=False", engine_batches(steps, sizes=ones, seed=seed, shuffle=False))]
    for k in buffer_chunks:
        batches = engine_batches(
            steps,
            sizes=sizes,
            seed=seed,
            shuffle=True,
            buffer_chunks=k,
            members=members,
            groups=groups,
        )
        rows.append(row(f"buffer_chunks={k}", batches, k))
    full = engine_batches(steps, sizes=ones, seed=seed, shuffle=True)
    rows.append(row("full permutation", full))
    return rows


def source_mixing(source: object, batch_size: int, **options: object) -> list[Mixing]:
    """:func:`window_mixing` for a shuffled ``PatchSource`` (its corners, blocks and
    super-blocks)."""
    members = source_chunk_members(source)
    groups = source_chunk_groups(source)
    corners = getattr(source, "corners", None)
    if members is None or groups is None or corners is None:
        raise ConfigError(
            f"mixing: {type(source).__name__} is not a shuffled PatchSource (no blocks of "
            "windows); build it with PatchSource(..., shuffle=True)"
        )
    return window_mixing(corners, members, groups, batch_size, **options)  # type: ignore[arg-type]


def format_mixing(
    rows: Sequence[Mixing], batch_size: int, notes: Mapping[str, str] | None = None
) -> list[str]:
    """The rows as a table; ``notes``: text appended to the row of that order."""
    notes = notes or {}
    lines = [
        f"mixing per batch of {batch_size} windows (spread: mean distance between a batch's "
        "windows / between random windows; trend: 1 when the epoch sweeps the array)"
    ]
    for r in rows:
        note = f"  {notes[r.order]}" if r.order in notes else ""
        lines.append(
            f"  {r.order:<18} blocks {r.units_mean:5.1f} (min {r.units_min:>3})  "
            f"super-blocks {r.groups_mean:5.1f}  spread {r.spread:.2f}  trend {r.trend:.2f}" + note
        )
    return lines
