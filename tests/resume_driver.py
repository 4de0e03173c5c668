"""A driver process for the resume test: trains with checkpoints until it is killed."""

import sys

import numpy as np
import torch
from conftest import TinyCNN

import dataflow as dfl


def pipeline(x: np.ndarray, y: np.ndarray) -> dfl.Pipeline:
    return dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=torch.nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(16, epochs_per_phase=1),
        progress=False,
    )


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 1, 8, 8)).astype(np.float32)
    return x, rng.integers(0, 3, size=1024)


if __name__ == "__main__":
    from dataflow.runtime.cluster import client_or_local_cluster

    with client_or_local_cluster(None, n_workers=2, announce=False) as client:
        pipeline(*data()).fit(epochs=int(sys.argv[2]), client=client, checkpoint_dir=sys.argv[1])
