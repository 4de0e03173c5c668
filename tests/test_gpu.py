"""Real CUDA runs: skipped where no GPU is present (run them on a GPU node)."""

import pytest
import torch
from conftest import TinyCNN, make_data, max_abs_diff, reference_training, sgd, tiny_pipeline

import dataflow as dfl
from dataflow import stages

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


# compared with the CPU's fp32 loop: "auto" would train in bf16 with channels_last on CUDA
FP32 = dict(precision="fp32", channels_last=False)


def _no_tf32() -> None:
    torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions differ from CPU at 1e-3


def test_one_cuda_replica_matches_the_cpu_loop(client):
    client.run(_no_tf32)
    x, y = make_data(64)
    result = tiny_pipeline(x, y, device="cuda", replicas=1, **FP32).fit(epochs=2, client=client)
    assert result.history.info["workers"][0]["device"].startswith("cuda")
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-4  # cuDNN vs CPU kernels


def test_two_replicas_on_one_gpu_reduce_through_gloo_and_warn(client):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): replicas that share
    a GPU reduce with gloo (CUDA tensors through host memory), and the user is told."""
    client.run(_no_tf32)
    x, y = make_data(64)
    pipe = tiny_pipeline(x, y, device="cuda", replicas=2, **FP32)
    with pytest.warns(RuntimeWarning, match="share a GPU"):
        result = pipe.fit(epochs=2, client=client)
    workers = result.history.info["workers"]
    assert {w["backend"] for w in workers} == {"gloo"}
    assert all(w["device"].startswith("cuda") and w["shared_gpu"] for w in workers)
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=2)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-4


def test_workers_claim_the_gpus_this_node_has_by_uuid(tmp_path):
    """The names a worker's GPU claim locks (runtime/gpu_claim.py) are the GPUs' UUIDs,
    one per visible GPU; on a one-GPU node a second claim shares it."""
    from dataflow.runtime.gpu_claim import claim_gpu, visible_gpu_ids

    ids = visible_gpu_ids()
    assert len(ids) == torch.cuda.device_count() and len(set(ids)) == len(ids)
    claims = [claim_gpu(ids, tmp_path) for _ in range(len(ids) + 1)]
    assert sorted(c.index for c in claims[:-1]) == list(range(len(ids)))
    assert claims[-1].sharers == 1
    for claim in claims:
        claim.release()


def test_an_embedded_cluster_starts_one_worker_per_gpu():
    """fit(client=None) on a GPU machine: one worker (one replica) per GPU, none shared,
    where a worker per core would have put them all on the GPUs together."""
    x, y = make_data(64)
    result = tiny_pipeline(x, y, device="cuda", **FP32).fit(epochs=1, client=None)
    workers = result.history.info["workers"]
    assert len(workers) == torch.cuda.device_count()
    assert not any(w["shared_gpu"] for w in workers)
    assert len({w["device"] for w in workers}) == len(workers)


def test_sync_batchnorm_on_one_gpu_equals_the_cpu_loop_on_an_uneven_split(client):
    """sync_batchnorm's reductions on CUDA tensors (gloo through the host: two replicas
    share the GPU), a replica with no samples in the last step taking part."""
    from test_sync_batchnorm import BatchNormCNN, distance, one_process

    client.run(_no_tf32)
    x, y = make_data(36)
    options = dict(model=BatchNormCNN, batch=32, balancer=dfl.balance.Proportional((3, 29)))
    pipe = tiny_pipeline(x, y, device="cuda", replicas=2, sync_batchnorm=True, **options, **FP32)
    with pytest.warns(RuntimeWarning, match="share a GPU"):
        result = pipe.fit(epochs=3, client=client)
    expected = one_process(x, y, tiny_pipeline(x, y, **options).sample_plan(3, 2))
    assert distance(result.model, expected) <= 1e-4  # cuDNN vs CPU kernels


def test_sync_batchnorm_in_paired_micro_batches_on_one_gpu_equals_the_cpu_loop(client):
    """The same on CUDA in micro-batches (max_micro_batch, as the memory cap a GPU fit
    learns adds them): each replica's k-th micro-batch reduced with the other's."""
    from test_sync_batchnorm import BatchNormCNN, distance, one_process_in_micro_batches

    client.run(_no_tf32)
    x, y = make_data(76)
    options = dict(batch=32, max_micro_batch=4, balancer=dfl.balance.Proportional((1, 7)))
    pipe = tiny_pipeline(
        x, y, model=BatchNormCNN, device="cuda", replicas=2, sync_batchnorm=True, **options, **FP32
    )
    with pytest.warns(RuntimeWarning, match="share a GPU"):
        result = pipe.fit(epochs=2, client=client)
    steps = [s for plan in pipe.plan(epochs=2, replicas=2) for s in plan.steps]
    expected = one_process_in_micro_batches(x, y, pipe.sample_plan(epochs=2, replicas=2), steps)
    assert distance(result.model, expected) <= 1e-4


def test_spatial_two_on_one_gpu_equals_single_process_training(client):
    """The partitioned model's CUDA path in a real fit: halo slabs packed on the GPU,
    sent through host memory (gloo point to point), BatchNorm-free TinyCNN."""
    import dataflow as dfl

    client.run(_no_tf32)
    x, y = make_data(64)
    options = dict(batch=16, device="cuda", layout=dfl.Layout(spatial=2), **FP32)
    with pytest.warns(RuntimeWarning, match="share a GPU"):
        result = tiny_pipeline(x, y, **options).fit(epochs=2, client=client)
    assert result.history.info["replicas"] == 1
    batches = tiny_pipeline(x, y, batch=16).sample_plan(epochs=2, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-4


def test_auto_trains_in_bf16_channels_last_on_cuda_as_the_same_cuda_loop(client):
    """precision="auto" and channels_last="auto" on an H100: bf16 autocast and
    channels_last, equal to the hand-written CUDA loop with those settings (to bf16's
    tolerance); compile=True compiles and agrees with that eager fit."""
    x, y = make_data(64)
    result = tiny_pipeline(x, y, device="cuda", replicas=1).fit(epochs=2, client=client)
    (worker,) = result.history.info["workers"]
    assert (worker["precision"], worker["memory_format"]) == ("bf16", "channels_last")
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=1)
    expected = _cuda_reference(x, y, batches)
    assert max_abs_diff(result.model, expected) <= 2e-2
    compiled = tiny_pipeline(x, y, device="cuda", replicas=1, compile=True)
    compiled = compiled.fit(epochs=2, client=client)
    assert max_abs_diff(compiled.model, result.model) <= 2e-2
    assert compiled.history.phases[0].compiled_shapes[0] >= 1


def _cuda_reference(x, y, batches):
    import numpy as np
    from conftest import TinyCNN, sgd

    torch.manual_seed(0)
    model = TinyCNN().cuda().to(memory_format=torch.channels_last)
    opt = sgd(model.parameters())
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    for parts in batches:
        index = torch.from_numpy(np.concatenate(parts)).cuda()
        xb = xt[index].contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(xb), yt[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.cpu()


def test_an_in_memory_source_is_uploaded_once_and_trains_as_from_the_host(client):
    """data_on_device="auto" uploads the small ArraySource to the GPU and gathers each
    batch there: the same batches, so the same weights as reading from host memory."""
    x, y = make_data(64)
    on_device = tiny_pipeline(x, y, device="cuda", replicas=1, **FP32).fit(epochs=2, client=client)
    from_host = tiny_pipeline(x, y, device="cuda", replicas=1, data_on_device=False, **FP32)
    from_host = from_host.fit(epochs=2, client=client)
    assert on_device.history.info["workers"][0]["data_on_device"] is True
    assert from_host.history.info["workers"][0]["data_on_device"] is False
    assert max_abs_diff(on_device.model, from_host.model) <= 1e-6


# -- captured steps (Pipeline(capture=True): forward, loss and backward as a CUDA graph) --


class BatchNormCNN(torch.nn.Module):
    """TinyCNN with BatchNorm (its running statistics are updated inside the graph) and
    no dropout (a captured step must compute what the eager step computes)."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Linear(8 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _exact_cuda(on: bool = True) -> None:
    """No TF32 (as ``_no_tf32``) and deterministic cuDNN on a worker: eager and
    captured steps then run the same kernels with the same sums (``on=False``: cuDNN
    free to choose again, TF32 left off as the other tests leave it)."""
    _no_tf32()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = on


def _captured_and_eager(client, device="cuda", epochs=3, **options):
    """The same fit (seed, batches, 12 steps of batch 16) eager and with capture=True."""
    x, y = make_data(64)
    fits = [
        tiny_pipeline(
            x, y, model=BatchNormCNN, device=device, replicas=1, capture=capture, **options
        ).fit(epochs=epochs, client=client)
        for capture in (False, True)
    ]
    return fits[0], fits[1]


def _losses(result):
    return [s["loss"] for s in result.history.steps]


def _captured_steps(result) -> int:
    """Steps that ran as a graph replay, over every phase and replica."""
    return sum(sum(phase.get("captured_steps") or [0]) for phase in result.history.phases)


def test_a_captured_fit_equals_the_eager_fit_in_fp32(client):
    """Same seed and batches, fp32, TF32 off, BatchNorm: the graph replays compute what
    the eager steps compute, to float rounding, and most steps were replays (each
    shape's first 2 steps run eager, the 3rd is captured)."""
    client.run(_exact_cuda)
    try:
        eager, captured = _captured_and_eager(client, **FP32)
    finally:
        client.run(_exact_cuda, False)
    assert _captured_steps(captured) > 0
    assert len(_losses(captured)) == len(_losses(eager)) == 12
    assert _losses(captured) == pytest.approx(_losses(eager), rel=1e-5)
    want = eager.model.state_dict()
    for name, got in captured.model.state_dict().items():
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_channels_last_captured_equals_eager_to_bf16_rounding(client):
    """bf16 autocast and channels_last inside the graph: the eager fit's results to
    bf16's rounding (8 bits of mantissa), as the auto test's tolerance."""
    eager, captured = _captured_and_eager(client, precision="bf16", channels_last=True)
    (worker,) = captured.history.info["workers"]
    assert (worker["precision"], worker["memory_format"]) == ("bf16", "channels_last")
    assert _captured_steps(captured) > 0
    assert _losses(captured) == pytest.approx(_losses(eager), rel=2e-2)
    assert max_abs_diff(captured.model, eager.model) <= 2e-2


class SyncErrors(stages.Stage):
    """After Update: from step ``start`` on, torch raises at any host-device sync
    (``torch.cuda.set_sync_debug_mode("error")``) from the start of each step's stages
    to the end of the last step of its window, so a window's own once-per-window reads
    (losses, the non-finite verdict) stay allowed and every per-step one fails."""

    def __init__(self, start: int) -> None:
        super().__init__("SyncErrors")
        self.start = start

    def _set(self, step, on: bool) -> None:
        if step.replica.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    def begin_step(self, step) -> None:
        if step.spec.index >= self.start:
            self._set(step, True)

    def run(self, step, grads):
        window = step.replica.window  # None outside a window (the driver's dry run)
        last_in_window = window is None or step.spec.index + 1 >= window[1]
        self._set(step, step.spec.index >= self.start and not last_in_window)
        return grads


def _sync_debug_off() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.set_sync_debug_mode("default")


def _sync_checked_fit(client, device="cuda", start=4, epochs=3):
    """A captured fp32 fit whose steps from ``start`` on fail at any host sync."""
    x, y = make_data(64)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(stages.Forward(BatchNormCNN, torch.nn.functional.cross_entropy), batch)
    grads = g.add(stages.Backward(), out)
    reduced = g.add(stages.AllReduce(), grads)
    # clipping and the weights' moving average: on the device too
    updated = g.add(stages.Update(sgd, clip_grad_norm=0.05, ema_decay=0.9), reduced)
    g.add(SyncErrors(start), updated)
    trainer = dfl.Trainer(
        g,
        schedule=dfl.schedule.Fixed(16),
        device=device,
        replicas=1,
        capture=True,
        progress=False,
        **FP32,
    )
    try:
        return trainer.fit(epochs=epochs, client=client)
    finally:
        client.run(_sync_debug_off)


def test_steady_captured_steps_make_no_host_sync(client):
    """Issue 37 item 1 with captured steps: from the 5th step on (the shape was
    captured at its 3rd and replayed at its 4th), no stage of a step reads the device
    on the host or waits for it; the window's results are read once, at its end."""
    result = _sync_checked_fit(client)
    assert _captured_steps(result) > 0
    assert len(result.history.steps) == 12
    assert result.ema_model is not None


def test_captured_micro_batches_equal_the_eager_accumulation(client):
    """max_micro_batch=6 on a local batch of 16 (6, 5, 5): the first micro-batch's graph
    writes the shared gradient buffers, the others add to them (one memory pool for the
    phase's graphs), to float rounding of the eager accumulation."""
    client.run(_exact_cuda)
    try:
        eager, captured = _captured_and_eager(client, max_micro_batch=6, **FP32)
    finally:
        client.run(_exact_cuda, False)
    assert _captured_steps(captured) > 0
    assert _losses(captured) == pytest.approx(_losses(eager), rel=1e-5)
    want = eager.model.state_dict()
    for name, got in captured.model.state_dict().items():
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_the_kept_weights_of_a_cuda_fit_score_on_the_gpu_what_the_fit_recorded(client):
    """keep_best on CUDA: the weights come back to the driver's CPU at each epoch's end;
    scored again on the GPU by Pipeline.evaluate, the kept weights give the held-out
    loss the fit recorded for their epoch (same GPU kernels, other batches)."""
    client.run(_no_tf32)
    x, y = make_data(160)
    held_out = dfl.io.ArraySource(x[128:], y[128:], shuffle=False)
    pipe = tiny_pipeline(x[:128], y[:128], device="cuda", replicas=1, eval_source=held_out, **FP32)
    result = pipe.fit(epochs=3, client=client, keep_best="eval_loss")
    best = result.history.info["best"]
    assert next(result.best_model.parameters()).device.type == "cpu"
    scored = pipe.evaluate(held_out, result.best_model, client=client)
    assert scored["loss"] == pytest.approx(best["value"], rel=1e-5)


def test_predictions_written_from_the_gpu_equal_the_cpus(client, tmp_path):
    """Pipeline.predict on a CUDA worker: the outputs come back to host rows and land in
    the store as a CPU worker writes them (cuDNN vs CPU kernels: 1e-4)."""
    import numpy as np
    import zarr

    client.run(_no_tf32)
    x, y = make_data(96)
    source = dfl.io.ArraySource(x, y, shuffle=False)
    torch.manual_seed(0)
    net = TinyCNN()  # (any weights will do)
    on_gpu = tiny_pipeline(x, y, device="cuda", **FP32).predict(
        source, net, tmp_path / "gpu.zarr", client=client
    )
    on_cpu = tiny_pipeline(x, y, device="cpu").predict(source, net, tmp_path / "cpu.zarr")
    gpu_rows = zarr.open_group(on_gpu)["prediction"][:]
    np.testing.assert_allclose(gpu_rows, zarr.open_group(on_cpu)["prediction"][:], atol=1e-4)


class _SyncErrorsDuring:
    """torch.cuda.set_sync_debug_mode("error") for a ``with`` block."""

    def __enter__(self) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")


def test_a_cuda_rollback_restores_the_commit_its_copies_were_enqueued_for():
    """A window's commit enqueues its host copies into page-locked memory on the compute
    stream (HostCopies); the next window's updates run after them on the stream, so a
    rollback restores the weights and momentum of the commit, bit for bit."""
    from test_host_copies import commit_then_train_then_roll_back

    commit_then_train_then_roll_back("cuda")


def test_a_window_commit_makes_no_host_sync():
    """Issue 37 item 1 at a window's start: the commit makes no host sync (it was one
    blocking copy per tensor, ~1,000 on ResNet-50 with its momentum: ~70 ms a window on
    an H200). The first run caches the page-locked blocks the second reuses."""
    from test_host_copies import commit_then_train_then_roll_back

    commit_then_train_then_roll_back("cuda")
    commit_then_train_then_roll_back("cuda", during_commit=_SyncErrorsDuring)
