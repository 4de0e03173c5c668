"""Mixed precision, channels_last and compiled steps (dataflow.core.precision): the
options validated where they are built, resolved per worker, and a fit in each setting
equal to the hand-written torch loop with the same settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    TinyCNN,
    learnable_labels,
    make_data,
    max_abs_diff,
    reference_training,
    tiny_pipeline,
)

import dataflow as dfl
from dataflow.core.errors import ConfigError
from dataflow.core.precision import CPU_FP16_ENV, LossScale, StepOptions, resolve_step_options
from dataflow.stages.compiled import to_memory_format

CPU = torch.device("cpu")


@pytest.fixture
def cpu_fp16(monkeypatch):
    """fp16 on the CPU, refused to users (many times slower than fp32), let through for
    the tests of the engine's loss scale (the driver passes it on to the workers)."""
    monkeypatch.setenv(CPU_FP16_ENV, "1")


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


def test_fp16_is_refused_on_the_cpu_naming_bf16_and_fp32(monkeypatch):
    """torch's CPU float16 autocast ran the digits 19x slower than fp32; the README said
    only "not faster". An explicit device="cpu" is refused where the Pipeline is built, a
    worker that "auto" put on the CPU when it resolves the options; "auto" never picks fp16."""
    monkeypatch.delenv(CPU_FP16_ENV, raising=False)
    x, y = make_data(32)
    refused = (
        r"^precision='fp16' on the CPU \(device='cpu'\): torch has no fast float16 kernels "
        r"there, so each step runs 8 to 30 times slower than in fp32 .* use precision='bf16' "
        r".* or 'fp32'"
    )
    with pytest.raises(ConfigError, match=refused):
        tiny_pipeline(x, y, precision="fp16")
    with pytest.raises(ConfigError, match=r"^precision='fp16' on the CPU \(device='auto' on a "):
        resolve_step_options("fp16", False, False, CPU, TinyCNN())
    assert resolve_step_options("auto", False, False, CPU, TinyCNN()).precision == "fp32"
    tiny_pipeline(x, y, precision="fp16", device="cuda")  # a GPU's: checked on its worker
    tiny_pipeline(x, y, precision="fp16", device="auto")
    monkeypatch.setenv(CPU_FP16_ENV, "1")  # tests only: the loss scale's tests on the CPU
    tiny_pipeline(x, y, precision="fp16")
    assert resolve_step_options("fp16", False, False, CPU, TinyCNN(), allow_cpu_fp16=True)


@pytest.mark.slow
def test_fp16_is_refused_on_a_worker_that_auto_put_on_the_cpu(client, monkeypatch):
    """device="auto": the worker resolves it and refuses; the fit raises the ConfigError."""
    monkeypatch.delenv(CPU_FP16_ENV, raising=False)
    x, y = make_data(64)
    pipe = tiny_pipeline(x, y, precision="fp16", device="auto", replicas=2)
    with pytest.raises(ConfigError, match=r"^precision='fp16' on the CPU \(device='auto' on a "):
        pipe.fit(epochs=1, client=client)


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


def test_cudagraphs_is_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="cudagraphs"):
        resolve_step_options("fp32", False, "cudagraphs", CPU, TinyCNN())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(sync=dfl.sync.Async(staleness=1)), "sync=Async"),
        (dict(sync=dfl.sync.Local(period_steps=2)), "sync=Local"),
        (dict(layout=dfl.Layout(spatial=2)), "a spatial layout"),
    ],
)
def test_fp16_is_refused_where_no_allreduced_gradient_decides_the_scale(options, named):
    x, y = make_data(32)
    with pytest.raises(ConfigError, match=f"precision='fp16' with {named}"):
        tiny_pipeline(x, y, precision="fp16", **options)


def test_compile_is_refused_with_a_spatial_layout():
    x, y = make_data(32)
    with pytest.raises(ConfigError, match="compile=True with a spatial layout"):
        tiny_pipeline(x, y, compile=True, layout=dfl.Layout(spatial=2))


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


class Loud(TinyCNN):
    """TinyCNN on inputs scaled by 3e3: fp16 gradients times the initial loss scale
    (2^16) overflow, so the scale must back off before any update applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 3e3)


class Warm(TinyCNN):
    """Inputs x 30: the first fp16 steps overflow at 2^16; at 8192 none do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 30.0)


def grad_scaler_loop(x, y, batches, model_class):
    """A user's fp16 loop with torch's GradScaler (its defaults: 2^16, halve on
    overflow, double after 2000 good steps), on the fit's batches."""
    torch.manual_seed(0)
    model = model_class()
    opt = sgd_(model)
    scaler = torch.amp.GradScaler("cpu")
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    skipped = 0
    for parts in batches:
        index = torch.from_numpy(np.concatenate(parts))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(xt[index]), yt[index])
        opt.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    return model, skipped, scaler.get_scale()


def sgd_(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("model_class", [TinyCNN, Loud], ids=["no-overflow", "overflow"])
def test_fp16_fit_skips_and_scales_as_torchs_grad_scaler(client, cpu_fp16, model_class):
    """Two replicas in fp16 with the engine's loss scale train as one process with
    torch's GradScaler: the same steps skipped for overflow (recorded, not a non-finite
    failure under on_non_finite="raise"), the same final scale, the same weights."""
    x, y = make_data(96)
    pipe = tiny_pipeline(x, y, model=model_class, precision="fp16", replicas=2)
    result = pipe.fit(epochs=2, client=client)
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=2)
    expected, skipped, scale = grad_scaler_loop(x, y, batches, model_class)
    (phase,) = result.history.phases
    assert (phase.overflow_steps, phase.loss_scale) == (skipped, scale)
    assert (skipped > 0) == (model_class is Loud)
    # fp16 rounds each replica's half batch apart from the whole batch; Loud's inputs
    # (x 3e3) amplify that into the weights
    assert max_abs_diff(result.model, expected) <= (1e-2 if model_class is Loud else 2e-3)
    assert {w["precision"] for w in result.history.info["workers"]} == {"fp16"}
    if skipped:
        assert f"{skipped} for an fp16 overflow (loss scale now {scale:g})" in result.summary()


def test_data_on_device_is_validated_and_stays_on_the_host_without_a_gpu():
    from dataflow.io.device_copy import device_copy

    x, y = make_data(32)
    with pytest.raises(ConfigError, match="data_on_device='yes'"):
        tiny_pipeline(x, y, data_on_device="yes")
    assert device_copy(dfl.io.ArraySource(x, y), CPU, True) is None  # CPU: nothing to upload


@pytest.mark.slow
def test_a_resumed_fp16_fit_keeps_its_loss_scale_and_is_bit_identical(client, cpu_fp16, tmp_path):
    """The loss scale is in every checkpoint: an fp16 fit stopped after 2 epochs and
    resumed to 4 equals the uninterrupted 4-epoch fit bit for bit. Warm overflows in its
    first steps (2^16 -> 8192), so a resume that began again from 2^16 would skip other
    steps."""
    x, y = make_data(128)

    def pipe() -> dfl.Pipeline:
        schedule = dfl.schedule.Fixed(16, epochs_per_phase=1)
        return tiny_pipeline(x, y, model=Warm, precision="fp16", replicas=2, schedule=schedule)

    pipe().fit(2, client=client, checkpoint_dir=tmp_path)
    resumed = pipe().fit(4, client=client, checkpoint_dir=tmp_path, resume=True)
    whole = pipe().fit(4, client=client)
    scales = [p.loss_scale for p in whole.history.phases]
    assert whole.history.phases[0].overflow_steps > 0 and scales[0] < 2.0**16
    assert [p.get("loss_scale") for p in resumed.history.phases] == scales
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


@pytest.mark.slow
def test_a_bf16_allreduce_trains_as_fp32_to_bf16s_tolerance(client):
    """``allreduce_dtype="bf16"``: two replicas whose gradient buckets travel as bf16
    land within bf16's rounding of the exact fp32 loop, measurably apart from it (the
    wire really was bf16), with fp32 parameters."""
    x, y = make_data(96)
    result = tiny_pipeline(x, y, replicas=2, allreduce_dtype="bf16").fit(2, client=client)
    batches = tiny_pipeline(x, y).sample_plan(epochs=2, replicas=2)
    exact = reference_training(x, y, batches=batches, seed=0)
    assert 1e-7 < max_abs_diff(result.model, exact) <= 2e-2
    assert result.model.state_dict()["conv.weight"].dtype == torch.float32


@pytest.mark.slow
def test_a_bf16_allreduce_meets_fp16_loss_scaling_and_the_noise_scale(client, cpu_fp16):
    """Features meet: fp16 autocast with the engine's loss scale, an Adaptive schedule
    measuring the gradient noise scale and held-out evaluation, all over a bf16 wire.
    The overflowed steps are the fp32 wire's (an inf stays inf in bf16), and the noise
    scale measured is the fp32 wire's to bf16's rounding (the local norms are taken
    from the unscaled fp32 buckets, before the rounding)."""
    x, _ = make_data(192)
    y = learnable_labels(x)  # a learnable signal
    options = dict(
        model=Loud,
        precision="fp16",
        replicas=2,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.002),
        schedule=dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0),
        eval_source=dfl.io.ArraySource(*make_data(32, seed=1)),
    )
    narrow = tiny_pipeline(x, y, allreduce_dtype="bf16", **options).fit(3, client=client)
    wide = tiny_pipeline(x, y, **options).fit(3, client=client)
    overflows = [p.overflow_steps for p in narrow.history.phases]
    assert overflows == [p.overflow_steps for p in wide.history.phases] and sum(overflows) > 0
    pairs = [
        (a.measured_noise_scale, b.measured_noise_scale)
        for a, b in zip(narrow.history.phases, wide.history.phases, strict=True)
    ]
    measured = [(a, b) for a, b in pairs if a is not None and b is not None]
    assert measured, pairs
    for a, b in measured:
        assert a == pytest.approx(b, rel=0.1)
    assert all(np.isfinite(e["eval_loss"]) for e in narrow.history.epochs)


def test_a_bf16_allreduce_is_refused_where_weights_travel():
    x, y = make_data(32)
    with pytest.raises(ConfigError, match=r"allreduce dtype 'bf16'.*sync=Local"):
        tiny_pipeline(x, y, allreduce_dtype="bf16", sync=dfl.sync.Local(period_steps=2))
    with pytest.raises(ConfigError, match=r"AllReduce\(dtype='fp8'\)"):
        tiny_pipeline(x, y, allreduce_dtype="fp8")
