"""Host work per step: a 1-replica fit of a model so small that its compute is
negligible, against a hand loop doing the same work, on the CPU (issue 37, item 1).

On a GPU the step is bound by the host's Python work, not the kernels; here the same
host work is measured where it is the only thing left. Both sides: the same 2-conv
TinyCNN at batch 8, the same batches in the same order (``dataflow.io.replica_streams``),
SGD, one torch thread, in this process. The fit runs on a ``LocalCluster(processes=False)``
with one single-threaded worker, so the replica's window task runs on a thread of this
process and is timed (and profiled) around ``ReplicaRuntime.run_window``:

* engine step: the steady windows' time inside ``run_window`` divided by their steps
  (the first ``--skip`` windows, calibration and warm-up, left out), i.e. everything the
  worker does per step, per-window work (the commit's state copy) spread over its steps;
* hand step: the same steps of a plain loop (index, forward, loss, backward, step,
  zero_grad), timed as a whole;
* overhead: engine step minus hand step, in microseconds; the ratio engine / hand.

Sides alternate (``--repeats`` of each, hand first), each after a quiet-machine wait;
the medians are reported. Then one more fit runs under ``cProfile`` (only the window
task's thread), and its steady windows' time is broken down by function (tottime, per
step) and by the engine's modules. Saved to ``benchmarks/results/step_host.json``.

    python benchmarks/bench_step_host.py            # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from quiet import wait_quiet
from records import save_run, table

NAME = "step_host"
ROOT = str(Path(__file__).resolve().parents[1]) + "/"  # the engine's own files start so


class TinyCNN(torch.nn.Module):
    """As tests/conftest.py's: two 3x3 convs and a linear head on 1x8x8 images."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.conv2 = torch.nn.Conv2d(4, 4, 3)
        self.head = torch.nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))


def narrow_resnet50() -> torch.nn.Module:
    """ResNet-50's 161 parameter tensors and 53 BatchNorms at width 2 on 3x16x16 images:
    the per-tensor host work of a real ResNet-50 step (the optimizer's, the engine's
    per-parameter checks and hooks) with almost no arithmetic, as on a GPU whose step
    is bound by launching ~1,000 kernels."""
    from gpu_models import ResNet50

    return ResNet50(width=2, classes=3)


MODELS = {  # name: (factory, one sample's shape)
    "tiny": (TinyCNN, (1, 8, 8)),
    "resnet50": (narrow_resnet50, (3, 16, 16)),
}


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def make_data(n: int, shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *shape)).astype(np.float32)
    y = rng.integers(0, 3, size=n).astype(np.int64)
    return x, y


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tiny",
        help="tiny: 2 convs and a head (6 tensors); resnet50: ResNet-50 at width 2 (161)",
    )
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--window-steps", type=int, default=128)
    p.add_argument("--skip", type=int, default=2, help="first windows left out (warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=25, help="functions in the profile table")
    p.add_argument("--max-wait", type=float, default=30.0, help="seconds to wait for quiet")
    p.add_argument(
        "--clip",
        type=float,
        default=None,
        help="both sides clip the gradient to this norm (the engine's clip_grad_norm=)",
    )
    p.add_argument(
        "--ema",
        type=float,
        default=None,
        help="both sides keep a moving average of the weights with this decay (the "
        "engine's ema_decay=; the hand loop: torch's AveragedModel EMA)",
    )
    p.add_argument("--label", default="", help="a note saved with the run (e.g. 'before')")
    p.add_argument("--out", help="JSON file (default benchmarks/results/step_host.json)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--dump", help="also write the profile here (pstats; snakeviz, pstats)")
    return p.parse_args(argv)


class WindowTimer:
    """Wraps ``ReplicaRuntime.run_window``: each window's (steps, seconds), and a
    cProfile of the window thread when ``profile`` is set."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, float]] = []
        self.profile: cProfile.Profile | None = None
        self.skip = 0

    def install(self) -> None:
        from dataflow.runtime.replica import ReplicaRuntime

        original = ReplicaRuntime.run_window
        timer = self

        def run_window(runtime: Any, first_step: int, stop_step: int, *a: Any, **k: Any) -> Any:
            profile = timer.profile if len(timer.windows) >= timer.skip else None
            t = time.perf_counter()
            if profile is not None:
                profile.enable()
            try:
                return original(runtime, first_step, stop_step, *a, **k)
            finally:
                if profile is not None:
                    profile.disable()
                timer.windows.append((stop_step - first_step, time.perf_counter() - t))

        ReplicaRuntime.run_window = run_window  # type: ignore[method-assign]

    def steady(self) -> tuple[int, float]:
        kept = self.windows[self.skip :]
        return sum(s for s, _ in kept), sum(t for _, t in kept)


def engine_fit(args: argparse.Namespace, client: Any, timer: WindowTimer) -> dict[str, Any]:
    import dataflow as dfl
    from dataflow import stages

    factory, shape = MODELS[args.model]
    x, y = make_data(args.samples, shape)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(stages.Forward(factory, F.cross_entropy), batch)
    reduced = g.add(stages.AllReduce(), g.add(stages.Backward(), out))
    g.add(stages.Update(sgd, clip_grad_norm=args.clip, ema_decay=args.ema), reduced)
    trainer = dfl.Trainer(
        g,
        schedule=dfl.schedule.Fixed(args.batch),
        device="cpu",
        progress=False,
        window_steps=args.window_steps,
        threads_per_replica=1,
    )
    timer.windows, timer.skip = [], args.skip
    result = trainer.fit(epochs=args.epochs, client=client)
    steps, seconds = timer.steady()
    return {
        "step_us": 1e6 * seconds / steps,
        "steps": steps,
        "losses": [s["loss"] for s in result.history.steps],
    }


def hand_batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """Each step's sample indices, as the fit reads them (one replica, seed 0)."""
    from dataflow.io import replica_streams
    from dataflow.planning.plan import phase_steps
    from dataflow.schedule import PhaseSpec
    from dataflow.schedule.balance import Even

    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=args.epochs, global_batch=args.batch)
    steps = phase_steps(num_samples=args.samples, phase=phase, split=lambda n: Even().split(n, 1))
    streams = replica_streams(steps, num_samples=args.samples, seed=0)
    return [torch.from_numpy(parts[0]) for _, parts in streams]


def hand_loop(args: argparse.Namespace) -> dict[str, Any]:
    """The plain loop over the same batches; timed over the fit's steady steps."""
    factory, shape = MODELS[args.model]
    x_np, y_np = make_data(args.samples, shape)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    torch.manual_seed(0)  # as the engine's build_model
    model = factory().train()
    optimizer = sgd(model.parameters())
    average = None
    if args.ema is not None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema))
    batches = hand_batches(args)
    first = args.skip * args.window_steps  # the steps the fit's steady windows start at
    losses = []
    for i, index in enumerate(batches):
        if i == first:
            t = time.perf_counter()
        xb, yb = x.index_select(0, index), y.index_select(0, index)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if average is not None:
            average.update_parameters(model)
        optimizer.zero_grad()
        losses.append(loss.detach())
    seconds = time.perf_counter() - t
    return {
        "step_us": 1e6 * seconds / (len(batches) - first),
        "losses": torch.stack(losses).tolist(),
    }


def breakdown(profile: cProfile.Profile, steps: int, top: int) -> dict[str, Any]:
    """Per step: own time (tottime) of the top functions, and of each module."""
    stats = pstats.Stats(profile)
    rows, modules = [], {}
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        ours = file.startswith(ROOT)
        short = file[len(ROOT) :] if ours else "/".join(file.split("/")[-2:])
        rows.append((tottime, cumtime, calls, f"{short}:{line}({func})"))
        if ours:
            module = short
        elif "/torch/" in file:
            module = "torch (Python)"
        elif file == "~":
            module = "C: " + func
        else:
            module = "other: " + short
        modules[module] = modules.get(module, 0.0) + tottime
    rows.sort(reverse=True)
    us = 1e6 / steps
    return {
        "functions": [
            {"function": f, "self_us": t * us, "cum_us": c * us, "calls_per_step": n / steps}
            for t, c, n, f in rows[:top]
        ],
        "modules": dict(sorted(((m, t * us) for m, t in modules.items()), key=lambda kv: -kv[1])),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from distributed import Client, LocalCluster

    torch.set_num_threads(1)
    timer = WindowTimer()
    timer.install()
    engine, hand = [], []
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        engine_fit(args, client, timer)  # warm-up: imports, first compile of everything
        for _ in range(args.repeats):
            wait_quiet(args.max_wait)
            hand.append(hand_loop(args))
            wait_quiet(args.max_wait)
            engine.append(engine_fit(args, client, timer))
        timer.profile = cProfile.Profile()
        profiled = engine_fit(args, client, timer)
        profile, timer.profile = timer.profile, None
    same = engine[-1]["losses"] == hand[-1]["losses"]
    e = statistics.median(r["step_us"] for r in engine)
    h = statistics.median(r["step_us"] for r in hand)
    parts = breakdown(profile, profiled["steps"], args.top)
    if args.dump:
        profile.dump_stats(args.dump)
    print(
        table(
            [
                [f"{r['step_us']:.1f}", f"{q['step_us']:.1f}"]
                for r, q in zip(engine, hand, strict=True)
            ],
            ["engine us/step", "hand us/step"],
        )
    )
    print(f"\nsame losses as the hand loop: {same}")
    print(f"engine {e:.1f} us/step, hand {h:.1f} us/step: overhead {e - h:.1f} us/step, ")
    print(f"ratio engine/hand {e / h:.2f}  (profiled fit: {profiled['step_us']:.1f} us/step)\n")
    print(
        table(
            [
                [
                    f["function"][:90],
                    f"{f['self_us']:.1f}",
                    f"{f['cum_us']:.1f}",
                    f"{f['calls_per_step']:.2f}",
                ]
                for f in parts["functions"]
            ],
            ["function (profiled, per step)", "self us", "cum us", "calls"],
        )
    )
    print()
    print(
        table(
            [[m[:70], f"{t:.1f}"] for m, t in list(parts["modules"].items())[: args.top]],
            ["module (own time, profiled)", "us/step"],
        )
    )
    run = {
        "label": args.label,
        "config": vars(args),
        "engine_step_us": [r["step_us"] for r in engine],
        "hand_step_us": [r["step_us"] for r in hand],
        "engine_median_us": e,
        "hand_median_us": h,
        "overhead_us": e - h,
        "ratio": e / h,
        "same_losses": same,
        "profiled_step_us": profiled["step_us"],
        "profile": parts,
    }
    path = save_run(NAME, run, args.out, overwrite=args.overwrite)
    print(f"\nsaved to {path}")
    return run


if __name__ == "__main__":
    main()
