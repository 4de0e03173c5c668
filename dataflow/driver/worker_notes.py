"""What the driver tells the user about the workers a group formed on: each one's
resolved step options go into ``history.info["workers"]``, and a setting the workers
cannot honour as asked is warned about once per fit."""

from __future__ import annotations

from typing import Any

from dataflow.core.user_warning import warn_user

SHARED_GPU_WARNING = (
    "replicas {ranks} share a GPU with another replica: NCCL cannot run two ranks on one "
    "GPU, so their gradients are reduced with gloo through host memory (correct, slower). "
    "For NCCL, run one worker per GPU: dask-cuda's LocalCUDACluster, or --gpus-per-node "
    "under mpirun (docs/hpc.md)"
)
CAPTURE_OFF_WARNING = (
    "capture=True, but replicas {ranks} run on workers without a CUDA device: their steps "
    "run eagerly (CUDA graphs need a GPU; device='auto' picked the CPU there)"
)

__all__ = ["CAPTURE_OFF_WARNING", "SHARED_GPU_WARNING", "record_workers"]


def record_workers(info: dict[str, Any], infos: list[dict[str, Any]], *, capture: bool) -> None:
    """Add a new group's worker ``infos`` to the history's ``info``; warn (once a fit)
    about replicas sharing a GPU and, with ``capture`` asked for, about replicas that
    cannot capture."""
    info["workers"] = info.get("workers", []) + infos
    shared = [i["rank"] for i in infos if i.get("shared_gpu")]
    if shared and not info.get("shared_gpu"):
        info["shared_gpu"] = shared
        warn_user(SHARED_GPU_WARNING.format(ranks=shared))
    eager = [i["rank"] for i in infos if capture and i.get("capture") == "off"]
    if eager and not info.get("capture_off"):
        info["capture_off"] = eager
        warn_user(CAPTURE_OFF_WARNING.format(ranks=eager))
