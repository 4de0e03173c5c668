"""The best settings by the cost model: worker count by goodput, the next batch by
goodput, window length and bucket size (a fit takes them unless the user set them:
:mod:`dataflow.driver.fit_settings`). Pure functions of a :class:`CostModel` and numbers.

Goodput is Pollux's (Qiao et al., OSDI 2021; petuum/adaptdl ``goodput.py``):
throughput × statistical efficiency, where the efficiency of a batch ``B`` relative to
the base batch ``B0``, with gradient noise scale ``B_noise``, is
``(B_noise + B0) / (B_noise + B)``: the progress per sample at ``B`` over that at
``B0``. It is 1 at ``B0`` and falls as ``B`` passes the noise scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from dataflow.core.errors import ConfigError
from dataflow.costmodel.model import MIB, CostModel


def statistical_efficiency(batch: float, noise_scale: float | None, base_batch: float) -> float:
    """Progress per sample at ``batch`` relative to ``base_batch`` (1 without a noise
    estimate: then nothing says a larger batch wastes samples)."""
    if batch <= 0 or base_batch <= 0:
        raise ConfigError(f"batch ({batch}) and base_batch ({base_batch}) must be > 0")
    if noise_scale is None:
        return 1.0
    noise = max(0.0, float(noise_scale))
    return (noise + base_batch) / (noise + batch)


def goodput(
    model: CostModel,
    *,
    replicas: int,
    global_batch: int,
    noise_scale: float | None,
    base_batch: int,
) -> float:
    """Useful samples per second: throughput × statistical efficiency."""
    rate = model.throughput(replicas=replicas, global_batch=global_batch)
    return rate * statistical_efficiency(global_batch, noise_scale, base_batch)


def best_replicas(
    model: CostModel,
    *,
    global_batch: int,
    max_replicas: int,
    min_replicas: int = 1,
    tolerance: float = 0.02,
) -> tuple[int, list[tuple[int, float]]]:
    """The worker count for a phase at ``global_batch``: the fewest replicas whose
    predicted throughput is within ``tolerance`` of the best in
    ``[min_replicas, max_replicas]`` (at a fixed batch the statistical efficiency is the
    same for every count, so goodput follows throughput; a worker that adds less than
    ``tolerance`` is not worth asking the cluster for). Returns the choice and the
    ``(replicas, samples/s)`` table it was chosen from."""
    if min_replicas < 1 or max_replicas < min_replicas:
        raise ConfigError(
            f"best_replicas: need 1 <= min_replicas ({min_replicas}) <= max_replicas "
            f"({max_replicas})"
        )
    top = min(max_replicas, global_batch)  # a replica with no samples adds nothing
    counts = range(min(min_replicas, top), top + 1)
    table = [(w, model.throughput(replicas=w, global_batch=global_batch)) for w in counts]
    best = max(rate for _, rate in table)
    choice = next(w for w, rate in table if rate >= (1 - tolerance) * best)
    return choice, table


def best_batch(
    model: CostModel,
    *,
    replicas: int,
    candidates: Iterable[int],
    noise_scale: float | None,
    base_batch: int,
) -> tuple[int, list[tuple[int, float]]]:
    """The candidate global batch with the highest goodput on ``replicas`` (ties: the
    smaller batch), and the ``(batch, goodput)`` table."""
    table = [
        (
            b,
            goodput(
                model,
                replicas=replicas,
                global_batch=b,
                noise_scale=noise_scale,
                base_batch=base_batch,
            ),
        )
        for b in sorted(set(candidates))
    ]
    if not table:
        raise ConfigError("best_batch: no candidate batch sizes")
    best = max(g for _, g in table)
    return next(b for b, g in table if g >= best * (1 - 1e-9)), table


def window_steps(
    model: CostModel,
    *,
    replicas: int,
    global_batch: int,
    overhead_fraction: float = 0.01,
    max_steps: int = 10_000,
) -> int:
    """The fewest steps per window that keep the engine's per-window cost under
    ``overhead_fraction`` of the window (1 %: a Dask round trip of ~1 ms hidden under
    ~0.1 s of work); more steps delay recovery and checkpoints, so no more than that."""
    if not 0 < overhead_fraction < 1:
        raise ConfigError(f"overhead_fraction={overhead_fraction}: must be in (0, 1)")
    step = model.replace(window_overhead_s=0.0, window_steps=1).breakdown(
        replicas=replicas, global_batch=global_batch
    )
    work = step.step_s
    if model.window_overhead_s <= 0 or work <= 0:
        return 1
    wanted = model.window_overhead_s * (1 - overhead_fraction) / (overhead_fraction * work)
    return max(1, min(max_steps, math.ceil(wanted)))


DEFAULT_BUCKET_CANDIDATES = tuple(int(m * MIB) for m in (0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64))


def bucket_bytes(
    model: CostModel,
    *,
    replicas: int,
    global_batch: int,
    candidates: Sequence[int] = DEFAULT_BUCKET_CANDIDATES,
) -> tuple[int, list[tuple[int, float]]]:
    """The allreduce bucket size with the least exposed allreduce time: small buckets
    start early but pay the latency once each, large ones hide less behind backward.
    Ties go to the larger bucket (fewer collectives). Returns the choice and the
    ``(bytes, exposed seconds)`` table."""
    table = []
    for size in sorted(set(candidates)):
        step = model.replace(bucket_bytes=int(size)).breakdown(
            replicas=replicas, global_batch=global_batch
        )
        table.append((int(size), step.allreduce_exposed_s))
    if not table:
        raise ConfigError("bucket_bytes: no candidate sizes")
    least = min(t for _, t in table)
    return max(b for b, t in table if t <= least * (1 + 1e-6) + 1e-12), table


WINDOW_SECONDS_RANGE = (0.1, 10.0)  # shorter: Dask dominates; longer: slow recovery


def window_seconds(model: CostModel, *, overhead_fraction: float = 0.01) -> float:
    """The work one window should carry so the engine's per-window cost is
    ``overhead_fraction`` of it: ``overhead × (1 - f) / f``, within 0.1 to 10 s (no
    shorter, since a task round trip is never free; no longer, since a lost worker
    costs up to one window of work and a checkpoint waits for a window's end)."""
    if not 0 < overhead_fraction < 1:
        raise ConfigError(f"overhead_fraction={overhead_fraction}: must be in (0, 1)")
    wanted = model.window_overhead_s * (1 - overhead_fraction) / overhead_fraction
    low, high = WINDOW_SECONDS_RANGE
    return min(high, max(low, wanted))
