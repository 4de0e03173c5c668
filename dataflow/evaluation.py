"""Scoring a trained model on held-out data after a fit: ``Pipeline.evaluate``.

The same scoring as a fit's evaluation at an epoch's end (``stages.Evaluate``): the
held-out set read as training reads it (a chunked store chunk by chunk, each chunk
decoded once, its chunks checked to exist; a remote store's objects fetched ahead), the
graph's deterministic transforms applied, each metric averaged over every sample. On a
``distributed.Client`` the set is split into one contiguous share per worker, the model
and the stage sent to each worker once; the shares' sums meet on the driver in share
order, so the scores do not depend on which worker finished first (or, a worker lost,
which one scored its share again).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError
from typing import Any

import torch

from dataflow.core.errors import ConfigError
from dataflow.runtime.cluster import available_workers, check_client
from dataflow.runtime.replica_spec import resolve_device
from dataflow.stages.evaluate import Evaluate

__all__ = ["contiguous_shares", "evaluate", "run_shares"]


def evaluate(
    model: torch.nn.Module,
    source: Any,
    *,
    metrics: Mapping[str, Callable[..., torch.Tensor]],
    transforms: Any = (),
    batch_size: int = 256,
    client: Any = None,
    device: str = "auto",
) -> dict[str, float]:
    """The mean of each of ``metrics`` over every sample of ``source`` scored by
    ``model``, and ``samples`` (how many). ``transforms``: applied to each batch before
    the model, as in ``Evaluate``. ``client``: a ``distributed.Client`` (or a scheduler
    address) to spread the set over its workers; None scores it in this process.
    ``device``: where each share is scored ("auto": a worker's GPU when it has one).
    ``model`` itself is not changed (a copy is scored)."""
    samples = checked_samples("evaluate", model, source)
    stage = Evaluate(source, metrics=dict(metrics), batch_size=batch_size, transforms=transforms)
    if client is None:
        shares = [score_share(stage, model, device, 0, samples)]
    else:
        shares = run_shares(client, "evaluate", score_share, stage, model, device, samples)
    count = sum(int(share["count"]) for share in shares)
    means = {key: math.fsum(share[key] for share in shares) / count for key in metrics}
    return {**means, "samples": count}


_VERB = {"evaluate": "score", "predict": "predict"}
# how often a run of shares is submitted again after losing its scattered inputs
LOST_INPUT_RETRIES = 3


def checked_samples(owner: str, model: Any, source: Any) -> int:
    """The samples of ``source``, once ``model`` is a module and ``source`` has samples;
    else a ``ConfigError`` naming ``owner``'s argument."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"{owner}(model={type(model).__name__}): give the trained torch.nn.Module, "
            "e.g. result.best_model or result.model"
        )
    samples = getattr(source, "num_samples", None)
    if not isinstance(samples, int) or samples < 1:
        raise ConfigError(
            f"{owner}(source={source!r}): a source with samples to {_VERB[owner]} "
            "(num_samples >= 1), e.g. dataflow.io.ZarrSource(path, x=..., shuffle=False)"
        )
    return samples


def contiguous_shares(samples: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[0, samples)`` cut into at most ``parts`` contiguous ``(lo, hi)`` shares as even
    as whole blocks of ``align`` samples allow, every boundary a multiple of ``align``
    (a writer's chunk: no two shares write one chunk); no share is empty. Pure."""
    blocks = -(-samples // align)
    count = max(1, min(parts, blocks))
    edges = [min(samples, align * (blocks * i // count)) for i in range(count + 1)]
    return list(itertools.pairwise(edges))


def score_share(stage: Evaluate, model: torch.nn.Module, device: str, lo: int, hi: int) -> dict:
    """Samples ``[lo, hi)`` scored by a copy of ``model`` on ``device``: the metric
    sums and their count (run on a worker, or in the driver's process)."""
    place = resolve_device(device, 0)
    scored = copy.deepcopy(model).to(place)
    return stage.score_range(scored, place, lo, hi)


def run_shares(
    client: Any,
    owner: str,
    task: Callable[..., Any],
    stage: Evaluate,
    model: torch.nn.Module,
    device: str,
    samples: int,
    *,
    align: int = 1,
    extra: tuple[Any, ...] = (),
) -> list[Any]:
    """``task(stage, model, device, lo, hi, *extra)`` for one contiguous share of the
    samples per worker of ``client`` (:func:`contiguous_shares`, boundaries on ``align``),
    the stage and the model sent to every worker once; the results in share order. A
    lost worker's share runs again on another (``allow_other_workers``).

    Once a worker's share is done, Dask's active memory manager may drop its copy of the
    scattered stage and model (no task there needs them), so a worker lost later can take
    the only copy with it, and the shares still to run are cancelled. Those are then
    submitted again, the stage and model scattered anew (``LOST_INPUT_RETRIES`` times);
    the shares done or running stay as they are."""
    from dataflow.runtime.cluster import client_or_local_cluster

    with client_or_local_cluster(client, device=device, announce=False) as active:
        check_client(active)
        workers = available_workers(active)
        if not workers:
            raise ConfigError(f"{owner}(client=...): the client has no workers")
        shares = contiguous_shares(samples, len(workers), align)
        placed = list(zip(workers, shares, strict=False))
        futures: list[Any] = [None] * len(placed)
        for attempt in range(LOST_INPUT_RETRIES + 1):
            sent = active.scatter([stage, model], broadcast=True, hash=False)
            for k, (worker, (lo, hi)) in enumerate(placed):
                if futures[k] is None or futures[k].status == "cancelled":
                    futures[k] = active.submit(
                        task,
                        *sent,
                        device,
                        lo,
                        hi,
                        *extra,
                        workers=[worker],
                        allow_other_workers=True,
                        pure=False,
                    )
            try:
                return active.gather(futures)
            except CancelledError:  # the scattered inputs were lost with a worker
                if attempt == LOST_INPUT_RETRIES:
                    raise
        raise AssertionError("unreachable")
