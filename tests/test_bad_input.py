"""Bad input fails fast on the driver with a specific error naming the fix."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, make_data, sgd, tiny_pipeline

import dataflow as dfl
from dataflow import stages


def pipeline(**overrides):
    x, y = make_data(64)
    return tiny_pipeline(x, y, **overrides)


def test_model_factory_returning_no_module():
    with pytest.raises(dfl.ModelError, match=r"returned dict, not a torch.nn.Module"):
        pipeline(model=lambda: {"not": "a module"}).fit(epochs=1)


def test_optimizer_factory_returning_no_optimizer():
    with pytest.raises(dfl.ModelError, match=r"not a torch\.optim\.Optimizer"):
        pipeline(optimizer=lambda params: list(params)).fit(epochs=1)


def test_loss_returning_non_scalar():
    def per_sample_loss(out, y):
        return F.cross_entropy(out, y, reduction="none")

    with pytest.raises(dfl.LossError, match=r"returned \(2,\), not a scalar.*reduction='mean'"):
        pipeline(loss=per_sample_loss).fit(epochs=1)


def test_batch_larger_than_dataset():
    with pytest.raises(dfl.BatchSizeError, match="global batch of 65 but the dataset has 64"):
        pipeline(schedule=dfl.schedule.Fixed(65)).fit(epochs=1)


@pytest.mark.parametrize("batch", [0, -3])
def test_nonpositive_batch(batch):
    with pytest.raises(dfl.BatchSizeError, match=rf"Fixed\(batch_size={batch}\)"):
        dfl.schedule.Fixed(batch)


def test_x_y_sample_counts():
    with pytest.raises(dfl.DataError, match="x has 64 samples but y has 63"):
        dfl.io.ArraySource(np.zeros((64, 1, 8, 8), np.float32), np.zeros(63, np.int64))


def test_unknown_stage_input():
    x, y = make_data(32)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(stages.Forward(TinyCNN, F.cross_entropy), "Lod")
    g.add(stages.Update(sgd), g.add(stages.Backward(), out))
    del batch
    with pytest.raises(dfl.GraphError, match=r"'Forward' has input 'Lod'.*stages: "):
        dfl.Trainer(g, schedule=dfl.schedule.Fixed(8), progress=False).fit(epochs=1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window_seconds": 0}, "window_seconds must be > 0"),
        ({"window_steps": 0}, "window_steps must be an int >= 1"),
        ({"replicas": 0}, "replicas must be an int >= 1"),
        ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda'"),
        ({"seed": 1.5}, "seed must be an int"),
    ],
)
def test_trainer_options(options, message):
    with pytest.raises(dfl.ConfigError, match=message):
        pipeline(**options)


def test_missing_schedule_and_bad_epochs():
    with pytest.raises(dfl.ConfigError, match=r"to train, give .* \(missing: schedule=;"):
        pipeline(schedule=None)
    with pytest.raises(dfl.ConfigError, match=r"epochs must be an int >= 1"):
        pipeline().fit(epochs=0)


def test_bad_stage_configs():
    with pytest.raises(dfl.ConfigError, match="bucket size in MiB must be > 0"):
        stages.AllReduce(bucket_mb=0)
    with pytest.raises(dfl.ConfigError, match="expected a model class or factory"):
        stages.Forward(3, F.mse_loss)
    with pytest.raises(dfl.ConfigError, match="prefetch is the number of batches"):
        stages.Load(dfl.io.ArraySource(np.zeros((4, 1))), prefetch=0)
    with pytest.raises(dfl.ConfigError, match="has no 'num_samples'"):
        stages.Load([1, 2, 3])


def test_errors_are_also_builtin_types():
    assert issubclass(dfl.BatchSizeError, ValueError)
    assert issubclass(dfl.ModelError, TypeError)
    assert issubclass(dfl.ChunkMissingError, KeyError)
    assert issubclass(dfl.GraphError, dfl.DataflowError)


def test_module_instance_is_accepted_as_initial_weights():
    torch.manual_seed(1)
    template = TinyCNN()
    plans = pipeline(model=template).plan(epochs=1, replicas=2)
    assert plans[0].steps[0].local_batches == (8, 8)
