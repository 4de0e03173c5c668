"""Real CUDA runs: skipped where no GPU is present (run them on a GPU node)."""

import pytest
import torch
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline

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
