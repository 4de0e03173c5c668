"""Streaming a store bigger than the worker's memory limit keeps the worker's memory bounded.

A real LocalCluster worker process with a 1.2 GB memory limit trains one epoch over
a 1.6 GB store (decoded size; it compresses to almost nothing on disk). Dask's
nanny would kill a worker that went over its limit; on top of that the worker's
peak resident memory during the fit is measured (``ru_maxrss``) and must stay
within the loader's bound: prefetched batches plus the shuffle buffer's chunks.
"""

import logging
import resource

import numpy as np
import pytest
import torch
import zarr
from distributed import Client, LocalCluster

import dataflow as dfl

pytestmark = pytest.mark.slow

SAMPLE = (1, 64, 64, 64)  # float32: 1 MiB a sample
PER_CHUNK = 8  # 8 MiB chunks


def _write_store(path, n):
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    x = group.create_array(
        "x",
        shape=(n, *SAMPLE),
        dtype="f4",
        chunks=(PER_CHUNK, *SAMPLE),
        config={"write_empty_chunks": True},
    )
    y = group.create_array("y", shape=(n, 1), dtype="f4", chunks=(n, 1))
    slab = np.zeros((PER_CHUNK * 16, *SAMPLE), dtype=np.float32)
    for start in range(0, n, len(slab)):
        stop = min(n, start + len(slab))
        slab[:, 0, 0, 0, 0] = np.arange(start, start + len(slab))  # each sample knows itself
        x[start:stop] = slab[: stop - start]
    y[:] = np.arange(n, dtype=np.float32)[:, None]
    return path


class PoolNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = torch.nn.AdaptiveAvgPool3d(2)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.pool(x).flatten(1))


def _pipeline(path, batch):
    return dfl.Pipeline(
        model=PoolNet,
        device="cpu",
        loss=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-6),
        source=dfl.io.ZarrSource(path, "x", "y"),
        schedule=dfl.schedule.Fixed(batch),
        prefetch=2,
        buffer_chunks=4,
        progress=False,
    )


def _peak_rss_bytes():
    """This process's own peak RSS: VmHWM, the high-water mark of its address space.
    (``ru_maxrss`` also counts the parent's peak when the process was started by
    vfork + exec, so a worker started from a large test process read as large.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def test_streaming_a_store_bigger_than_memory_keeps_the_worker_bounded(tmp_path):
    n, batch = 1600, 16
    big = _write_store(tmp_path / "big.zarr", n)  # 1.6 GiB decoded
    small = _write_store(tmp_path / "small.zarr", 64)
    memory_limit = 1200 * 2**20
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            memory_limit=memory_limit,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):
        _pipeline(small, batch).fit(epochs=1, client=client)  # imports, allocator warm
        [before] = client.run(_peak_rss_bytes).values()
        result = _pipeline(big, batch).fit(epochs=1, client=client)
        [after] = client.run(_peak_rss_bytes).values()
        workers = len(client.scheduler_info()["workers"])
    assert workers == 1  # the nanny did not kill and replace it
    phase = result.history.phases[0]
    assert phase["chunks_decoded"] == [n // PER_CHUNK]  # each chunk once
    assert result.ledger.consumed(0).tolist() == list(range(n))
    # Live chunks: the batch, the shuffle groups it spans (2 x 4 chunks), two cut chunks;
    # plus one batch's first-used chunks decoded ahead (the batch, a group, two cut chunks).
    live = batch + 2 * 4 * PER_CHUNK + 2 * PER_CHUNK
    bound_samples = live + (batch + 4 * PER_CHUNK + 2 * PER_CHUNK)
    assert phase["peak_buffered_samples"][0] <= bound_samples
    store_bytes = n * 2**20
    # The measured peak growth: decoded chunks held, the output buffers (prefetch 2 + the
    # 4 of Load's slack: the pool keeps at most 6, reused), zarr's decode buffers for one
    # request, torch's activations.
    growth = max(0, after - before)
    budget = (bound_samples + 6 * batch) * 2**20 + 256 * 2**20
    print(
        f"\nworker peak RSS before {before / 2**20:.0f} MiB, after {after / 2**20:.0f} MiB: "
        f"growth {growth / 2**20:.0f} MiB for a {store_bytes / 2**30:.2f} GiB store "
        f"(limit {memory_limit / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB)"
    )
    assert after < memory_limit < store_bytes
    assert growth <= budget
