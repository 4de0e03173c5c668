"""One dataflow ``Pipeline.fit`` of a :class:`~workloads.Workload` on a LocalCluster
started for it, with the diagnosis switches of the benchmarks' ``--worker-*`` options."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch.nn.functional as F
from measure import freeze_gc, install_gc_probe, read_gc_probe, task_gaps
from processes import START_ENV, _malloc_env, environment, pin_process
from workloads import ModelFactory, OptimizerFactory, Workload, make_data, ship_to_workers

from dataflow.runtime.malloc import relax_malloc


def run_fit(
    work: Workload,
    *,
    replicas: int,
    window_seconds: float,
    malloc_trim: str = "dask-default",
    bucket_mb: float = 25.0,
    worker_profile: bool = True,
    pin: bool = False,
    engine_relax_malloc: bool = True,
    gc_freeze: bool = False,
) -> dict[str, Any]:
    """``Pipeline.fit`` on a LocalCluster of ``replicas`` single-threaded worker processes.

    The cluster is started (and its workers awaited) before the fit and closed after,
    so its start-up is not in any figure. ``malloc_trim``: ``"dask-default"`` is what
    users get; ``"unset"`` drops the ``MALLOC_TRIM_THRESHOLD_=65536`` that Dask's Nanny
    puts in the workers' environment; ``"mallopt"`` keeps it but calls
    :func:`relax_malloc` in each worker before the fit (the in-process remedy).
    ``worker_profile=False`` turns off the Dask workers' statistical profiler (a thread
    that samples the task thread's Python stack every 10 ms). ``pin``: worker ``i`` (in
    rank order) and all its threads on core ``i`` (diagnosis).
    ``engine_relax_malloc=False``: ``Pipeline(relax_malloc=False)``, the engine does not
    undo ``MALLOC_TRIM_THRESHOLD_`` (engines before that option: the only behaviour).
    ``gc_freeze``: import torch and dataflow in each worker, then ``gc.collect()`` and
    ``gc.freeze()`` before the fit (diagnosis). Full garbage collections in the workers
    are timed in every case (:func:`install_gc_probe`).
    """
    import dask
    from distributed import Client, get_task_stream

    import dataflow
    from dataflow.runtime.cluster import start_local_cluster

    ship_to_workers()
    x, y = make_data(work.samples, work.model, work.seed)
    options: dict[str, Any] = {}
    if "relax_malloc" in {f.name for f in dataclasses.fields(dataflow.TrainerConfig)}:
        options["relax_malloc"] = engine_relax_malloc
    elif not engine_relax_malloc:
        raise SystemExit("this dataflow has no relax_malloc option (it never relaxes malloc)")
    pipe = dataflow.Pipeline(
        model=ModelFactory(work.model),
        loss=F.cross_entropy,
        optimizer=OptimizerFactory(work.optim),
        source=dataflow.io.ArraySource(x, y, shuffle=True),
        schedule=dataflow.schedule.Fixed(work.batch),
        seed=work.seed,
        progress=False,
        threads_per_replica=1,
        window_seconds=window_seconds,
        replicas=replicas,
        bucket_mb=bucket_mb,
        **options,
    )
    config: dict[str, Any] = {}
    if malloc_trim == "unset":
        config["distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"] = None
    if not worker_profile:
        config["distributed.worker.profile.enabled"] = False
    with (
        dask.config.set(config),
        environment(START_ENV),
        start_local_cluster(replicas) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(replicas)
        if malloc_trim == "mallopt":
            client.run(relax_malloc)
        if pin:  # worker i (in dataflow's rank order) on core i
            from dataflow.runtime.cluster import live_workers

            workers = live_workers(client)
            order = sorted(workers, key=lambda a: (workers[a].get("host", ""), a))
            for rank, address in enumerate(order):
                client.run(pin_process, rank, workers=[address])
        if gc_freeze:
            client.run(freeze_gc)
        worker_env = client.run(_malloc_env)
        client.run(install_gc_probe)
        started = time.perf_counter()
        with get_task_stream(client) as stream:
            result = pipe.fit(epochs=work.epochs, client=client)
        wall = time.perf_counter() - started
        gc_pauses = client.run(read_gc_probe)
    relaxed = {str(w.get("malloc_relaxed")) for w in result.history.info["workers"]}
    return {
        "history": result.history.to_dict(),
        "fit_call_seconds": wall,
        "gaps": [task_gaps(stream.data, r) for r in range(replicas)],
        "worker_env": [*sorted(set(worker_env.values())), f"engine malloc_relaxed={relaxed}"],
        "worker_gc": list(gc_pauses.values()),
    }
