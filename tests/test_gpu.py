"""Real CUDA runs: skipped where no GPU is present (run them on a GPU node)."""

import pytest
import torch
from conftest import make_data, max_abs_diff, reference_training, tiny_pipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_one_cuda_replica_matches_the_cpu_loop():
    x, y = make_data(64)
    result = tiny_pipeline(x, y, device="cuda", replicas=1).fit(epochs=2)
    assert result.history.info["workers"][0]["device"].startswith("cuda")
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-4  # cuDNN vs CPU kernels
