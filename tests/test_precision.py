"""Mixed precision, channels_last and compiled steps (dataflow.core.precision): the
options validated where they are built, resolved per worker, and a fit in each setting
equal to the hand-written torch loop with the same settings."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyCNN, make_data, max_abs_diff, reference_training, tiny_pipeline

from dataflow.core.errors import ConfigError
from dataflow.core.precision import LossScale, StepOptions, resolve_step_options
from dataflow.stages.compiled import to_memory_format

CPU = torch.device("cpu")


class Volumes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean((1, 2, 3, 4))


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("precision", "half", "precision='half'"),
        ("precision", "float16", "precision='float16'"),
        ("channels_last", "yes", "channels_last='yes'"),
        ("compile", "fast", "compile='fast'"),
    ],
)
def test_a_bad_step_option_names_the_field_and_the_choices(option, value, named):
    x, y = make_data(32)
    with pytest.raises(ConfigError, match=named) as info:
        tiny_pipeline(x, y, **{option: value})
    assert "use" in str(info.value)


def test_auto_is_fp32_and_contiguous_on_the_cpu():
    options = resolve_step_options("auto", "auto", False, CPU, TinyCNN())
    assert options == StepOptions(precision="fp32", memory_format=None, compile=None)
    assert not options.autocast


def test_channels_last_follows_the_convolutions():
    two_d = resolve_step_options("bf16", True, False, CPU, TinyCNN())
    three_d = resolve_step_options("bf16", True, True, CPU, Volumes())
    assert (two_d.memory_format, two_d.precision) == ("channels_last", "bf16")
    assert (three_d.memory_format, three_d.compile) == ("channels_last_3d", "default")
    with pytest.raises(ConfigError, match="convolutions are absent"):
        resolve_step_options("fp32", True, False, CPU, torch.nn.Linear(3, 3))
    with pytest.raises(ConfigError, match="spatial layout"):
        resolve_step_options("fp32", True, False, CPU, TinyCNN(), spatial=True)


def test_fp16_and_cudagraphs_are_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="fp16"):
        resolve_step_options("fp16", False, False, CPU, TinyCNN())
    with pytest.raises(ConfigError, match="cudagraphs"):
        resolve_step_options("fp32", False, "cudagraphs", CPU, TinyCNN())


def test_batches_take_the_models_memory_format():
    x4, x5 = torch.zeros(2, 3, 4, 5), torch.zeros(2, 1, 3, 4, 5)
    assert to_memory_format(x4, torch.channels_last).is_contiguous(
        memory_format=torch.channels_last
    )
    assert to_memory_format(x4, None) is x4
    assert to_memory_format(x5, torch.channels_last) is x5  # 5-D needs channels_last_3d
    both = to_memory_format((x4, torch.zeros(2)), torch.channels_last)
    assert both[0].is_contiguous(memory_format=torch.channels_last) and both[1].ndim == 1


def test_loss_scale_halves_on_overflow_and_grows_after_good_steps():
    scale = LossScale(scale=1024.0, growth_interval=3)
    scale.update(overflowed=True)
    assert scale.scale == 512.0
    for _ in range(3):
        scale.update(overflowed=False)
    assert (scale.scale, scale.good_steps) == (1024.0, 0)
    copy = LossScale()
    copy.load_state_dict(scale.state_dict())
    assert copy.scale == scale.scale


@pytest.mark.slow
def test_bf16_channels_last_fit_equals_the_same_hand_written_loop(client):
    """Two replicas in bf16 autocast with channels_last weights and batches train as the
    single-process torch loop with the same settings does (to bf16's tolerance), and
    really computed in bf16: the fp32 loop lands measurably elsewhere."""
    x, y = make_data(96)
    options = dict(precision="bf16", channels_last=True, replicas=2)
    result = tiny_pipeline(x, y, **options).fit(epochs=2, client=client)
    workers = result.history.info["workers"]
    assert {(w["precision"], w["memory_format"], w["compile"]) for w in workers} == {
        ("bf16", "channels_last", "eager")
    }
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=2)
    bf16 = reference_training(
        x,
        y,
        batches=batches,
        seed=0,
        autocast_dtype=torch.bfloat16,
        memory_format=torch.channels_last,
    )
    fp32 = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, bf16) <= 2e-2
    assert max_abs_diff(bf16, fp32) > 1e-4  # autocast changed the arithmetic
    weights = result.model.state_dict()["conv.weight"]
    assert weights.dtype == torch.float32  # parameters stay fp32
    assert all(torch.isfinite(t).all() for t in result.model.state_dict().values())


@pytest.mark.slow
def test_compiled_fit_agrees_with_eager_and_compiles_once_per_shape(client):
    """compile=True: the model compiled on each replica agrees with eager training
    within 1e-4 (inductor reorders float sums), and a phase compiles at most two input
    shapes (its batch, and the epoch's last shorter step)."""
    x, y = make_data(40)
    eager = tiny_pipeline(x, y, replicas=2).fit(epochs=2, client=client)
    compiled = tiny_pipeline(x, y, replicas=2, compile=True).fit(epochs=2, client=client)
    assert max_abs_diff(eager.model, compiled.model) <= 1e-4
    (phase,) = compiled.history.phases
    assert all(1 <= n <= 2 for n in phase.compiled_shapes)
    assert all(s > 0 for s in phase.compile_seconds)
    assert {w["compile"] for w in compiled.history.info["workers"]} == {"default"}
    assert eager.history.phases[0].compiled_shapes is None
