"""The hand-written torch loop a dataflow fit is compared with, over exactly the
batches the fit visits."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from workloads import ModelFactory, OptimizerFactory, Workload, make_data

from dataflow.runtime.malloc import relax_malloc


def timed_steps(
    model: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor, batches: list, pick: Any
) -> dict[str, Any]:
    """The plain training loop both baselines run, timed per step.

    ``pick(parts)`` gives a step's sample indices from each replica's parts. Per step:
    index the tensors (timed as ``load``), forward, loss, backward, ``step()``,
    ``zero_grad(set_to_none=True)``; ``ends[i]``: end of step ``i`` since the start.
    """
    loads, seconds, ends, losses, samples = [], [], [], [], []
    started = time.perf_counter()
    for parts in batches:
        t0 = time.perf_counter()
        index = pick(parts)
        xb, yb = x.index_select(0, index), y.index_select(0, index)
        t1 = time.perf_counter()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        losses.append(loss.detach())
        loads.append(t1 - t0)
        seconds.append(t2 - t0)
        ends.append(t2 - started)
        samples.append(sum(len(part) for part in parts))
    return {
        "started": started,
        "loads": loads,
        "seconds": seconds,
        "ends": ends,
        "losses": losses,
        "samples": samples,
    }


def planned_batches(work: Workload, replicas: int) -> list[list[torch.Tensor]]:
    """Per step, each replica's sample indices, exactly as a dataflow fit reads them."""
    from dataflow.io import replica_streams
    from dataflow.planning.plan import phase_steps
    from dataflow.schedule import PhaseSpec
    from dataflow.schedule.balance import Even

    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=work.epochs, global_batch=work.batch)
    steps = phase_steps(
        num_samples=work.samples, phase=phase, split=lambda n: Even().split(n, replicas)
    )
    streams = replica_streams(steps, num_samples=work.samples, seed=work.seed)
    return [[torch.from_numpy(part) for part in parts] for _, parts in streams]


def hand_loop(work: Workload, threads: int, relax: bool = False) -> dict[str, Any]:
    """The plain torch loop (:func:`timed_steps`) over exactly the batches a dataflow
    fit visits. ``relax``: call :func:`relax_malloc` first."""
    if relax:
        relax_malloc()
    torch.set_num_threads(threads)
    batches = planned_batches(work, replicas=1)
    x_np, y_np = make_data(work.samples, work.model, work.seed)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    torch.manual_seed(work.seed)  # what dataflow's build_model does before the factory
    model = ModelFactory(work.model)().train()
    optimizer = OptimizerFactory(work.optim)(model.parameters())
    steps = timed_steps(model, optimizer, x, y, batches, torch.cat)
    return {
        "torch_threads": torch.get_num_threads(),
        "total_seconds": time.perf_counter() - steps["started"],
        "load_seconds": steps["loads"],
        "step_seconds": steps["seconds"],
        "ends": steps["ends"],
        "losses": torch.stack(steps["losses"]).tolist(),
    }
