"""Shared fixtures: tiny CNNs and data, and one real LocalCluster for the session."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dask.config
import hypothesis
import numpy as np
import pytest
import torch

import dataflow as dfl

# The fit machine checks its state's invariants after every event in every test
# (dataflow.driver.state.validate_state); a fit run by a user does not pay for it.
os.environ["DATAFLOW_VALIDATE_DRIVER"] = "1"

# Property tests draw the same examples in every CI run (CI=true): a run that lands
# nothing because a random draw found a rare case is a flaky CI, and a draw that finds
# one is worth more kept (an @example) than lost with the run. Run without CI=true, they
# draw anew each time: that is where the search for new cases goes on (test_driver_simulated
# found a driver bug so, docs/architecture.md says how to search longer).
hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")

# What a worker process imports to run the engine's tasks, preloaded once in the
# forkserver that every LocalCluster worker of the session (a nanny's restart too) is
# forked from.
WORKER_PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim's first optimizer imports it: seconds per process
    "numba",
    "zarr",
    "dataflow",
    "dataflow.runtime.plugin",
    "dataflow.runtime.replica",
    "dataflow.runtime.tasks",
    "dataflow.stages",
    "dataflow.ps.service",
)


def pytest_configure(config):
    """Worker processes forked from a warm server, not spawned: a spawned worker imports
    torch, Numba and the engine afresh (3-4 s of CPU on 2 cores, before its first task
    runs and again after every kill), and the slow tier starts hundreds of them. The
    forkserver is itself a fresh process (no pytest threads are forked); it starts at
    the first cluster, so the ``not slow`` tier never pays for it. Workers behave as
    spawned ones: ``__main__`` is imported again (the script guard still matters), and
    what they share is read-only imported code. distributed's own test suite does the
    same."""
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    from distributed.utils import get_mp_context

    context = get_mp_context()  # distributed's own preload list, set once
    context.set_forkserver_preload(["distributed", "numpy", *WORKER_PRELOAD])


class TinyCNN(torch.nn.Module):
    """Small enough to train in milliseconds, with conv, bias and linear parameters."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.conv2 = torch.nn.Conv2d(4, 4, 3)
        self.head = torch.nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))


def make_data(n: int = 160, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=n).astype(np.int64)
    return x, y


def learnable_labels(x: np.ndarray) -> np.ndarray:
    """Three classes that follow a signal in ``make_data``'s inputs (the mean of a corner
    of the first channel), so the true gradient is not zero (|G|^2 > 0)."""
    return np.digitize(x[:, 0, :4, :4].mean(axis=(1, 2)), [-0.1, 0.1])


def noise_pairs_fed(monkeypatch) -> list[tuple]:
    """Every gradient-norm pair the driver feeds its noise tracker in this test, as fed
    (``Recorder._track_noise``, spied on)."""
    from dataflow.driver.recorder import Recorder

    fed: list[tuple] = []
    track = Recorder._track_noise

    def spy(recorder, pairs):
        fed.extend(pairs)
        return track(recorder, pairs)

    monkeypatch.setattr(Recorder, "_track_noise", spy)
    return fed


def _squared_norm(model: torch.nn.Module) -> float:
    return float(sum(p.grad.double().pow(2).sum() for p in model.parameters()))


class WitnessPairs(dfl.stages.AllReduce):
    """AllReduce that also takes every step's pair as the engine did before its norms
    stayed on the device: floats read inside the step (a host sync each), this replica's
    |g_r|^2 from its own gradient before the allreduce writes the mean back (fp16's loss
    scale divided out), the reduced |G|^2 after. One JSON line per step, replica and
    attempt (a step run again after a loss writes again) in ``pairs.<pid>.jsonl``: step,
    local batch, |g_r|^2, global batch, |G|^2, wall time."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def run(self, step, grads):
        from dataflow.stages.allreduce import loss_scale_of

        local_sq = _squared_norm(step.replica.model) / loss_scale_of(step.replica) ** 2
        out = super().run(step, grads)
        line = [step.spec.index, step.local_batch, local_sq, step.global_batch]
        line += [_squared_norm(step.replica.model), time.time()]
        with open(Path(self.folder) / f"pairs.{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        return out


class ObservedReads:
    """Mixed into a real ZarrSource: :meth:`observe` sees every decode request, made
    through ``read_chunks`` or, for a batch of whole chunks, ``read_chunks_into``."""

    def observe(self, chunks) -> None:
        raise NotImplementedError

    def read_chunks(self, chunks):
        self.observe(chunks)
        return super().read_chunks(chunks)

    def read_chunks_into(self, chunks, blocks):
        self.observe(chunks)
        return super().read_chunks_into(chunks, blocks)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference_training(
    x,
    y,
    *,
    batches,
    seed,
    optimizer=sgd,
    after_backward=None,
    lrs=None,
    autocast_dtype=None,
    memory_format=None,
) -> torch.nn.Module:
    """The plain single-process torch loop over ``batches`` (global batches of indices);
    ``lrs``: the LR of each step, when a schedule changes it; ``autocast_dtype`` and
    ``memory_format``: a user's mixed-precision, channels_last loop."""
    torch.manual_seed(seed)
    model = TinyCNN()
    if memory_format is not None:
        model = model.to(memory_format=memory_format)
    opt = optimizer(model.parameters())
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for step, parts in enumerate(batches):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        index = torch.from_numpy(np.concatenate(parts))
        xb = xt[index]
        if memory_format is not None:
            xb = xb.contiguous(memory_format=memory_format)
        with torch.autocast(
            "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=bool(autocast_dtype)
        ):
            loss = torch.nn.functional.cross_entropy(model(xb), yt[index])
        opt.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        opt.step()
    return model


def in_process(
    trainer: dfl.Trainer, epochs: int, micro_batches: int = 1, device: str = "cpu", **spec: Any
):
    """One replica of ``trainer``'s graph in this process (as the dry run builds it) on
    ``device``, its phase begun: the runtime and the phase's steps. ``spec``: more
    ``ReplicaSpec`` fields (``commit_windows=False``: commits only when a test makes them)."""
    from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec
    from dataflow.stages.base import PhaseContext

    order = trainer.graph.validate(replicas=1)
    spec = ReplicaSpec(
        run_id="test", graph=trainer.graph, order=order, seed=0, device=device, **spec
    )
    runtime = ReplicaRuntime(spec, rank=0, world_size=1, collective=None)
    [plan] = trainer.plan(epochs, 1)
    steps = plan.steps
    if micro_batches > 1:
        steps = tuple(dataclasses.replace(s, micro_batches=(micro_batches,)) for s in steps)
    runtime.begin_phase(PhaseContext(index=0, steps=steps, lr=None))
    return runtime, steps


def tiny_pipeline(x, y, *, batch: int = 16, **options) -> dfl.Pipeline:
    """The Pipeline most tests train: TinyCNN, cross entropy, SGD with momentum; on
    ``source=`` instead of arrays ``x``, ``y`` when given (then pass None for both)."""
    defaults = dict(
        model=TinyCNN,
        device="cpu",  # compared with CPU references; tests/test_gpu.py asks for "cuda"
        loss=torch.nn.functional.cross_entropy,
        optimizer=sgd,
        source=options["source"] if "source" in options else dfl.io.ArraySource(x, y),
        schedule=dfl.schedule.Fixed(batch),
        progress=False,
    )
    return dfl.Pipeline(**{**defaults, **options})


def held_out_pipeline(x, y, *, train: int = 128, **options) -> dfl.Pipeline:
    """``tiny_pipeline`` on the first ``train`` samples, ``Fixed(16)``, evaluating every
    epoch on the rest (in order): the fits that watch a held-out metric."""
    held_out = dfl.io.ArraySource(x[train:], y[train:], shuffle=False)
    defaults = dict(schedule=dfl.schedule.Fixed(16), eval_source=held_out)
    return tiny_pipeline(x[:train], y[:train], **{**defaults, **options})


def assert_the_balancer_followed_the_throttle(
    phases, *, slow: int, factor: float, waiting=("Load", "AllReduce"), smoothing: float = 1.0
) -> None:
    """What a fit with replica ``slow`` throttled ``factor`` x under
    ``balance.Throughput(smoothing)`` decided, whatever the machine's speed: phase 0 split
    evenly; in every phase the slow replica alone paused ``factor - 1`` times its compute
    (``stage_seconds["throttle"]``) and its recorded samples/s counts that pause (1 /
    ``factor`` of its speed without it); each later phase split by the balancer from the
    speeds recorded before it. ``waiting``: the stages that wait on peers or data
    (not compute). Asserts on what was decided from the measured times, never on them."""
    from dataflow.schedule.balance import Throughput

    for phase in phases:
        for rank, seconds in enumerate(phase["stage_seconds"]):
            waits = (*waiting, "throttle", "peer_wait")  # (the pause: apart, added below)
            compute = sum(v for name, v in seconds.items() if name not in waits)
            paused = seconds.get("throttle", 0.0)
            assert paused == pytest.approx((factor - 1) * compute if rank == slow else 0.0)
            rate = phase["samples_trained"][rank] / (compute + paused)
            assert phase["samples_per_second"][rank] == pytest.approx(rate), (phase, rank)
    balancer = Throughput(smoothing=smoothing)
    for k, phase in enumerate(phases):  # phase 0: nothing measured, an even split
        speeds = [p["samples_per_second"] for p in phases[:k]]
        chosen = balancer.split(phase["global_batch"], len(phase["local_batches"]), speeds)
        assert phase["local_batches"] == list(chosen), (k, phase["local_batches"], speeds)


def gloo_pair(store: Any, prefix: str, timeout_s: float = 3600.0) -> list[Any]:
    """Ranks 0 and 1 of one real gloo group in this process, formed in two threads (each
    waits for the other); the default timeout is far beyond any test's patience."""
    import threading

    from dataflow.runtime.collective import Collective

    made: dict[int, Collective] = {}

    def join(rank: int) -> None:
        made[rank] = Collective(
            store,
            rank=rank,
            world_size=2,
            device=torch.device("cpu"),
            host="127.0.0.1",
            timeout_s=timeout_s,
            prefix=prefix,
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return [made[0], made[1]]


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def lagging_driver(monkeypatch, lag: Any) -> None:
    """The fit's driver stops for ``lag(n)`` seconds right after it queues windows the
    ``n``-th time (0, 1, ...), as on a loaded machine: it gathers no result meanwhile,
    and the replicas run whatever they were queued."""
    from dataflow.driver import commands as cmd
    from dataflow.driver.loop import COMMAND_HANDLERS

    queue = COMMAND_HANDLERS[cmd.SubmitWindows]
    calls = itertools.count()

    def lagging(loop, command):
        queue(loop, command)
        seconds = lag(next(calls))
        if seconds:
            time.sleep(seconds)

    monkeypatch.setitem(COMMAND_HANDLERS, cmd.SubmitWindows, lagging)


@pytest.fixture(autouse=True)
def _sync_debug_mode_reset():
    """A CUDA test that fails with ``torch.cuda.set_sync_debug_mode("error")`` on must not
    fail every later one: the mode is process-wide, so it is set back after each test."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="session")
def client():
    """A real LocalCluster, as fit() starts one: two single-threaded worker processes."""
    from dataflow.runtime.cluster import client_or_local_cluster

    with client_or_local_cluster(None, n_workers=2, announce=False) as c:
        yield c


@contextlib.contextmanager
def nanny_cluster(workers: int):
    """A client of ``workers`` nanny-managed single-threaded workers whose killed workers
    come back (for modules that SIGKILL them). A LocalCluster closes the nanny of a
    worker not back within lost-worker-timeout (15 s): on a loaded machine a restart
    can take longer, so it is 300 s here."""
    from distributed import Client

    from dataflow.runtime.cluster import EmbeddedCluster  # (survives a worker removed twice)

    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "300s"}),
        EmbeddedCluster(n_workers=workers, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        yield client


def digits_accuracy(client, data: dict, **options) -> float:
    """Held-out accuracy after 10 epochs of TinyCNN (10 classes) on sklearn's digits
    (``dataflow.tools.datasets.digits_arrays``), 2 replicas, batch 64, SGD with momentum 0.9:
    the digits fits that compare synchronization policies."""
    pipe = dfl.Pipeline(
        model=functools.partial(TinyCNN, classes=10),  # digits: 1 x 8 x 8, 10 classes
        loss=torch.nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        source=dfl.io.ArraySource(data["x_train"], data["y_train"]),
        eval_source=dfl.io.ArraySource(data["x_test"], data["y_test"], shuffle=False),
        metrics={"accuracy": dfl.stages.accuracy},
        replicas=2,
        device="cpu",
        progress=False,
        **{"schedule": dfl.schedule.Fixed(64), **options},
    )
    return float(pipe.fit(epochs=10, client=client).history.epochs[-1]["eval_accuracy"])


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server behind a latency proxy (tests/object_store.py), for one module."""
    from object_store import s3_server

    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def s3_stores(s3, tmp_path_factory):
    """The same data twice: a local zarr store of make_data(256), and its copy in the
    bucket (``s3.upload``)."""
    local = dfl.io.to_zarr(
        tmp_path_factory.mktemp("s3") / "train.zarr", *make_data(256), chunk_mb=0.01
    )
    return local, s3.upload(local, "train.zarr")


@pytest.fixture
def no_aws_environment(monkeypatch, tmp_path):
    """No credentials, endpoint or profile from this machine's environment or files
    (botocore would look there); no s3fs filesystem cached with other options."""
    from object_store import close_sessions

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    close_sessions()
    yield monkeypatch
    close_sessions()


@pytest.fixture(scope="session")
def pool2():
    """A gloo group of 2 spawned processes (``dataflow.spatial.local_group.LocalGroup``),
    shared by the spatial tests: each spawn imports torch, seconds per process on 2 cores."""
    from dataflow.spatial.local_group import LocalGroup

    pool = LocalGroup(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    """As ``pool2``, of 4 processes."""
    from dataflow.spatial.local_group import LocalGroup

    pool = LocalGroup(4)
    yield pool
    pool.close()


# Fixtures that start processes (a LocalCluster's workers, a LocalGroup's ranks): every
# test using one is slow.
PROCESS_FIXTURES = frozenset({"client", "empty_cluster", "cluster_client", "pool2", "pool4"})


@pytest.hookimpl(tryfirst=True)  # before ``-m "not slow"`` deselects
def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test that starts processes through a cluster fixture, so the
    ``not slow`` tier never starts one (a module's own ``pytestmark`` stays as it is);
    skip the fault soak unless ``-m`` names it (it runs for half an hour)."""
    soak = "soak" in (config.option.markexpr or "")
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if not soak and item.get_closest_marker("soak") is not None:
            item.add_marker(pytest.mark.skip(reason="the fault soak: pytest -m soak"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Report a failure even when formatting its traceback fails.

    CPython 3.11 before 3.11.8 keeps the AST converter's recursion depth in state that
    all threads share (python/cpython#106905): when pytest parses a failing test's
    source while a Dask, Numba or torch thread also converts an AST, ``ast.parse``
    raises ``SystemError: AST constructor recursion depth mismatch`` and pytest stops
    the whole session with an INTERNALERROR, hiding which test failed. Format it again
    (the race is momentary), then fall back to the exception's own text."""
    try:
        return (yield)
    except (SystemError, Warning) as error:
        # (pluggy rewraps it as PluggyTeardownRaisedWarning, an error under -W error)
        if "recursion depth mismatch" not in str(error):
            raise
    from _pytest.reports import TestReport

    try:
        return TestReport.from_item_and_call(item, call)
    except SystemError:
        pass  # raced again
    excinfo = call.excinfo
    text = f"{excinfo.typename}: {excinfo.value}" if excinfo else "failed"
    if excinfo is not None and excinfo.traceback:
        entry = excinfo.traceback[-1]
        text = f"{entry.path}:{entry.lineno + 1}: {text}"
    return TestReport(
        item.nodeid,
        item.location,
        {name: 1 for name in item.keywords},
        "failed",
        f"{text}\n(traceback not shown: CPython's AST converter raised SystemError while "
        "pytest formatted it; python/cpython#106905)",
        call.when,
        item._report_sections,
        call.duration,
        call.start,
        call.stop,
        item.user_properties,
    )


def run_benchmark(script: str, out: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """``python benchmarks/<script> *args --out <out>`` in a subprocess (a benchmark's
    smoke run, usually ``--tiny``): the one run it saved, after asserting it exited 0."""
    done = subprocess.run(
        [sys.executable, script, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[1] / "benchmarks",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [run] = json.loads(Path(out).read_text())["runs"]
    return run
