"""The bucketed allreduce on a real (single-rank) gloo process group."""

import pytest
import torch
from conftest import TinyCNN

from dataflow.runtime.collective import Collective, open_store
from dataflow.stages.reducer import BucketReducer


def single_rank_collective(prefix: str) -> Collective:
    store = open_store("127.0.0.1", 1, 30.0)
    return Collective(
        store,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        host="127.0.0.1",
        timeout_s=30.0,
        prefix=prefix,
    )


class LaunchRecorder:
    """A real gloo collective that also records, at each launch, how many grads were missing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = single_rank_collective("test")
        self.rank = 0
        self.model = model
        self.missing_at_launch: list[int] = []

    def allreduce_async(self, tensor):
        self.missing_at_launch.append(sum(p.grad is None for p in self.model.parameters()))
        return self.inner.allreduce_async(tensor)

    def wait(self, work):
        return self.inner.wait(work)


def grads_of(model):
    return [p.grad.clone() for p in model.parameters()]


def test_buckets_launch_during_backward_and_weight_the_gradient():
    torch.manual_seed(0)
    model = TinyCNN()
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 3, (6,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = grads_of(model)
    model.zero_grad(set_to_none=True)

    recorder = LaunchRecorder(model)
    reducer = BucketReducer(list(model.parameters()), recorder, cap_bytes=600)
    assert len(reducer.buckets) >= 3
    reducer.begin_step(weight=0.25)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    # The first bucket started while backward still had gradients to produce: overlap.
    assert recorder.missing_at_launch[0] > 0
    assert len(recorder.missing_at_launch) == len(reducer.buckets)
    reducer.finish()
    for got, want in zip(grads_of(model), expected, strict=True):
        torch.testing.assert_close(got, 0.25 * want, rtol=1e-6, atol=1e-8)
    reducer.close()


def test_replica_without_samples_contributes_zeros_and_gets_grads():
    model = TinyCNN()
    recorder = LaunchRecorder(model)
    reducer = BucketReducer(list(model.parameters()), recorder, cap_bytes=10**6)
    reducer.begin_step(weight=0.0)
    reducer.finish()  # no backward at all
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert len(recorder.missing_at_launch) == len(reducer.buckets) == 1


def test_hooks_are_inert_outside_a_step():
    model = TinyCNN()
    recorder = LaunchRecorder(model)
    BucketReducer(list(model.parameters()), recorder, cap_bytes=600)
    model(torch.randn(2, 1, 8, 8)).sum().backward()  # e.g. a user's own backward
    assert recorder.missing_at_launch == []


def test_aborted_group_refuses_collectives():
    collective = single_rank_collective("abort")
    collective.abort()
    assert collective.closed
    with pytest.raises(Exception, match="was aborted because another replica"):
        collective.allreduce_async(torch.ones(2))


def test_the_reduced_squared_norm_is_left_on_the_device_and_measured_once():
    torch.manual_seed(0)
    model = TinyCNN()
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 3, (6,))
    recorder = LaunchRecorder(model)
    reducer = BucketReducer(list(model.parameters()), recorder, cap_bytes=600)
    reducer.begin_step(weight=0.5, measure=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    reducer.finish()
    expected = sum(p.grad.double().pow(2).sum() for p in model.parameters())
    assert isinstance(reducer.grad_sq, torch.Tensor) and reducer.grad_sq.dtype == torch.float64
    torch.testing.assert_close(reducer.grad_sq, expected, rtol=1e-12, atol=0)
    # one rank: the reduced gradient is the packed (weighted) local one; both left on
    # the device as 0-d tensors (read once per window, not per step)
    assert isinstance(reducer.local_sq, torch.Tensor) and reducer.local_sq.dim() == 0
    torch.testing.assert_close(reducer.local_sq, expected, rtol=1e-12, atol=0)
    reducer.begin_step(weight=0.5)  # a step that does not measure takes no local norm
    torch.nn.functional.cross_entropy(model(x), y).backward()
    reducer.finish()
    assert reducer.local_sq is None and reducer.grad_sq is not None
    reducer.close()


def test_a_windows_pairs_are_read_to_the_host_at_once_without_skipped_steps():
    """AllReduce leaves a measured step's squared norms on the device; the replica reads
    a window's pairs together at its end, as floats, leaving out the steps whose update
    was dropped (an fp16 overflow has no finite norm)."""
    from dataflow.runtime.window_parts import host_pairs

    local, reduced = torch.tensor(2.5, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    pairs = [
        (3, 4, local / 0.25, 8, reduced),
        (4, 4, 1.5, 8, 0.5),  # already on the host (local updates measure once per window)
        (5, 4, torch.tensor(float("inf")), 8, reduced),
    ]
    got = host_pairs(pairs, skipped=[5])
    assert got == [(3, 4, 10.0, 8, 1.0), (4, 4, 1.5, 8, 0.5)]
    assert all(isinstance(v, int | float) for pair in got for v in pair)
    assert host_pairs([]) == []


def test_a_bf16_wire_sends_half_the_bytes_and_leaves_fp32_gradients():
    """``AllReduce(dtype="bf16")``: each bucket travels as bf16, once rounded from the
    weighted fp32 bucket; the gradients written back are fp32 and equal that rounding
    (one rank: the sum is the bucket itself), and a measured step's local norm is taken
    before the rounding (exact fp32)."""
    torch.manual_seed(0)
    model = TinyCNN()
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 3, (6,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = grads_of(model)
    model.zero_grad(set_to_none=True)

    sent = []

    class Wire(LaunchRecorder):
        def allreduce_async(self, tensor):
            sent.append((tensor.dtype, tensor.numel() * tensor.element_size()))
            return super().allreduce_async(tensor)

    reducer = BucketReducer(
        list(model.parameters()), Wire(model), cap_bytes=600, wire_dtype=torch.bfloat16
    )
    reducer.begin_step(weight=0.25, measure=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    reducer.finish()
    assert {dtype for dtype, _ in sent} == {torch.bfloat16}
    assert sum(n for _, n in sent) * 2 == sum(g.numel() * 4 for g in expected)
    for param, grad in zip(model.parameters(), expected, strict=True):
        assert param.grad.dtype == torch.float32
        rounded = (0.25 * grad).to(torch.bfloat16).float()
        assert torch.equal(param.grad, rounded)
        assert (param.grad - 0.25 * grad).abs().max() <= 2**-8 * (0.25 * grad).abs().max()
    exact_sq = sum(float((0.25 * g).pow(2).sum()) for g in expected)
    assert float(reducer.local_sq) == pytest.approx(exact_sq, rel=1e-6)
