"""A driver process for the Ctrl-C test: ``fit(client=None)`` (an embedded LocalCluster)
that runs until it is interrupted. A worker's first loss call writes the file named by
``argv[1]``: the replicas are training."""

import faulthandler
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from conftest import TinyCNN

import dataflow as dfl


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:  # the dry run, on the driver
        pass
    else:
        Path(sys.argv[1]).touch()
        time.sleep(0.01)  # slow steps that leave the CPUs to the test
    return torch.nn.functional.cross_entropy(out, target)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the test's: where it hangs
    # Ctrl-C as in a terminal, whatever started the suite: a job started in the
    # background of a script ignores SIGINT, and so would this driver, never stopping
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 1, 8, 8)).astype(np.float32)
    pipe = dfl.Pipeline(
        model=TinyCNN,
        device="cpu",
        loss=loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        source=dfl.io.ArraySource(x, rng.integers(0, 3, size=1024)),
        schedule=dfl.schedule.Fixed(8),
        progress=False,
    )
    pipe.fit(epochs=50, client=None)  # minutes: the test interrupts it
