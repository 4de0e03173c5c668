"""Where the eager ResNet-50 fit's extra host time per step comes from (issue 37).

bench_gpu.py measured the eager ResNet-50 fit at 0.57x (bf16 + channels_last) and
0.72x (fp32) of its hand loop on an H200, while the captured fit beat the eager loop:
the eager step is bound by the host, and the fit's host time per step is about 1.5x
the loop's, though it dispatches only ~10 more ops a step (counted on the CPU). This
probe runs the same hand loop where the fit runs it, one difference at a time, and the
fit beside it, so that the cause is a measurement:

* ``main``: the hand loop in this process's main thread (bench_gpu's loop);
* ``threads1``: the same with ``torch.set_num_threads(1)`` (a replica worker's setting);
* ``thread``: in a second thread of this process;
* ``loader``: in the main thread while a loader thread gathers each batch on a side
  stream, two batches ahead (what Load does with a source resident on the device);
* ``worker``: inside a Dask worker (LocalCluster, one process, one thread), as a task;
* ``fit``: the engine's fit, eager; ``fit_no_commit``: without the per-window host
  copy of the state (``recover_lost_workers=False``); ``fit_host_data``: batches from
  host memory (``data_on_device=False``);
* ``fit_profiled``: torch.profiler around the fit inside the worker (every thread's
  ops, the CUDA runtime calls): the synchronizing calls and the top host ops by self time.

Each row: samples/s (steady, CUDA-event clock for loops, the driver's for fits) and
host ms per step by part (the loop's data / forward / backward / step; the fit's
stages). ``--device cpu --tiny`` runs every row at toy size (the code a GPU call runs).

    python benchmarks/probe_gpu_host.py --out benchmarks/results/gpu_host_probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import sys
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_models import ResNet50, sgd  # noqa: E402
from gpu_workloads import classes_data  # noqa: E402

SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cudaStreamWaitEvent",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaMalloc",
    "cudaFree",
)


def settings(tiny: bool, steps: int) -> dict[str, Any]:
    px, width, samples, batch = (32, 8, 32, 4) if tiny else (128, 64, 1024, 128)
    return {"px": px, "width": width, "samples": samples, "batch": batch, "steps": steps}


def hand_loop(
    size: dict[str, Any],
    device: str,
    bf16: bool,
    loader: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    """bench_gpu's resident hand loop, timed by part: samples/s over the steps after
    the first 8 (CUDA events), host ms per step in data, forward, backward and step."""
    if threads is not None:
        torch.set_num_threads(threads)
    cuda = device == "cuda"
    dev = torch.device(device)
    x_np, y_np = classes_data(size["samples"], (3, size["px"], size["px"]), 1000)
    x, y = torch.from_numpy(x_np).to(dev), torch.from_numpy(y_np).to(dev)
    torch.manual_seed(0)
    model = ResNet50(width=size["width"]).to(dev).train()
    fmt = torch.channels_last
    if bf16:
        model = model.to(memory_format=fmt)
    opt = sgd(model.parameters())
    g = torch.Generator().manual_seed(0)
    batch, steps = size["batch"], size["steps"]
    indices = [
        torch.randperm(size["samples"], generator=g)[:batch].to(dev) for _ in range(steps)
    ]  # fmt: skip
    host = dict.fromkeys(("data", "forward", "backward", "step"), 0.0)
    batches: queue.Queue | None = None
    if loader:  # a thread gathers each batch on a side stream, two batches ahead
        batches = queue.Queue(maxsize=2)

        def load() -> None:
            side = torch.cuda.Stream() if cuda else None
            for idx in indices:
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
                        done = torch.cuda.Event()
                        done.record(side)
                else:
                    xb, yb, done = x.index_select(0, idx), y.index_select(0, idx), None
                batches.put((xb, yb, done))

        threading.Thread(target=load, daemon=True).start()
    marks: list[Any] = []

    def now() -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    if cuda:
        torch.cuda.synchronize()
    start = now()
    for k, idx in enumerate(indices):
        t0 = time.perf_counter()
        if batches is not None:
            xb, yb, done = batches.get()
            if done is not None:
                torch.cuda.current_stream().wait_event(done)
                xb.record_stream(torch.cuda.current_stream())
                yb.record_stream(torch.cuda.current_stream())
        else:
            xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        if bf16:
            xb = xb.contiguous(memory_format=fmt)
        t1 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(xb), yb)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if k >= 8:
            for part, seconds in zip(host, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                host[part] += seconds
        marks.append(now())
    if cuda:
        torch.cuda.synchronize()
        ends = [start.elapsed_time(m) / 1000 for m in marks]
    else:
        ends = [m - start for m in marks]
    counted = steps - 8
    return {
        "samples_per_s": counted * batch / (ends[-1] - ends[7]),
        "host_ms_per_step": {k: round(1000 * v / counted, 3) for k, v in host.items()},
        "thread": threading.current_thread().name,
        "torch_threads": torch.get_num_threads(),
    }


def in_thread(*args: Any, **kwargs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: found.update(hand_loop(*args, **kwargs)))
    thread.start()
    thread.join()
    return found


def fit(size: dict[str, Any], device: str, bf16: bool, client: Any, **options: Any) -> Any:
    import dataflow as dfl

    x, y = classes_data(size["samples"], (3, size["px"], size["px"]), 1000)
    extra = {"precision": "bf16", "channels_last": True} if bf16 else {"precision": "fp32"}
    pipe = dfl.Pipeline(
        model=lambda: ResNet50(width=size["width"]),
        loss=F.cross_entropy,
        optimizer=sgd,
        source=dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(size["batch"]),
        device=device,
        replicas=1,
        progress=False,
        **extra,
        **options,
    )
    epochs = max(1, size["steps"] * size["batch"] // size["samples"])
    return pipe.fit(epochs=epochs, client=client)


def fit_row(result: Any) -> dict[str, Any]:
    from measure import steady_boundary, steady_fit, window_ends

    steps = result.history.steps
    phase = result.history.phases[0]
    first = steady_boundary(steps, 8)
    return {
        "samples_per_s": steady_fit(steps, first).samples_per_second,
        "host_ms_per_step": {
            stage: round(1000 * seconds / phase.steps, 3)
            for stage, seconds in phase.stage_seconds[0].items()
        },
        "first_step": first,
        "window_ends": window_ends(steps),
        "step_options": {
            k: result.history.info["workers"][0].get(k)
            for k in ("precision", "memory_format", "capture", "data_on_device")
        },
    }


def profiler_start() -> str:
    """Starts torch.profiler in the calling thread: as a task, the worker's one executor
    thread, where the fit's windows run (the profiler records the ops of the thread it
    started in, and the CUDA runtime calls of the whole process)."""
    from distributed import get_worker
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.__enter__()
    get_worker()._dataflow_probe_profiler = prof  # a probe's own attribute
    return threading.current_thread().name


def profiler_stop(top: int) -> dict[str, Any]:
    from distributed import get_worker

    prof = get_worker()._dataflow_probe_profiler
    prof.__exit__(None, None, None)
    averages = prof.key_averages()
    calls = {
        e.key: {"count": e.count, "ms": round(e.cpu_time_total / 1000, 2)}
        for e in averages
        if e.key in SYNC_CALLS
    }
    ranked = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "profiled_thread": threading.current_thread().name,
        "runtime_calls": calls,
        "top_self_cpu": [
            {"op": e.key, "count": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 2)}
            for e in ranked[:top]
        ],
    }


def profiled_fit(size: dict[str, Any], device: str, bf16: bool, client: Any, top: int) -> Any:
    """The fit with torch.profiler on in the worker's executor thread."""
    started_in = client.submit(profiler_start, pure=False).result()
    try:
        row = fit_row(fit(size, device, bf16, client))
    finally:
        found = client.submit(profiler_stop, top, pure=False).result()
    row.update(found, started_in=started_in)
    return row


def probes(
    size: dict[str, Any], device: str, bf16: bool, client: Any, top: int
) -> list[tuple[str, Any]]:
    """(row name, call) for one precision, in the order they run."""
    args = (size, device, bf16)

    def fitted(**options: Any) -> Any:
        return functools.partial(lambda: fit_row(fit(*args, client, **options)))

    def restore_threads() -> dict[str, Any]:
        torch.set_num_threads(os.cpu_count() or 1)
        return {"torch_threads": torch.get_num_threads()}

    return [
        ("main", functools.partial(hand_loop, *args)),
        ("worker", lambda: client.submit(hand_loop, *args, pure=False).result()),
        ("fit", fitted()),
        ("loader", functools.partial(hand_loop, *args, loader=True)),
        ("thread", functools.partial(in_thread, *args)),
        ("threads1", functools.partial(hand_loop, *args, threads=1)),
        ("restore_threads", restore_threads),
        ("fit_no_commit", fitted(recover_lost_workers=False)),
        ("fit_host_data", fitted(data_on_device=False)),
        ("fit_profiled", functools.partial(profiled_fit, *args, client, top)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--precisions", nargs="*", default=["bf16", "fp32"])
    p.add_argument("--out", default=None)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--steps", type=int, default=48, help="steps per loop and fit (48)")
    p.add_argument("--rows", nargs="*", default=None, help="only these rows (all)")
    args = p.parse_args()
    size = settings(args.tiny, args.steps)
    rows: dict[str, Any] = {"size": size}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    def record(name: str, call: Any) -> None:
        started = time.perf_counter()
        try:
            rows[name] = call()
        except Exception as error:  # one broken row must not cost the others
            rows[name] = {"error": f"{type(error).__name__}: {error}"}
        rows[name]["wall_s"] = round(time.perf_counter() - started, 1)
        shown = {k: v for k, v in rows[name].items() if k not in ("top_self_cpu",)}
        print(f"{name}: {json.dumps(shown)}", flush=True)
        save()

    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, dashboard_address=":0", silence_logs=40
        ) as cluster,
        Client(cluster) as client,
    ):
        client.run(lambda: sys.path.insert(0, HERE))
        for precision in args.precisions:
            for name, call in probes(size, args.device, precision == "bf16", client, args.top):
                if args.rows is None or name in args.rows:
                    record(f"{precision} {name}", call)
            for entry in rows.get(f"{precision} fit_profiled", {}).get("top_self_cpu", []):
                print(f"   {entry['self_ms']:9.2f} ms {entry['count']:7d}  {entry['op']}")
    save()


if __name__ == "__main__":
    main()
