"""The Adaptive schedule: batch growth from the measured noise scale, LR rules. Pure."""

import itertools
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.schedule import Adaptive, Fixed, PhaseMeasurement, PhaseSpec, Schedule, Stepwise
from dataflow.schedule.noise_scale import adascale_gain

# The target rule alone, as before min_efficiency and may_shrink: the arithmetic of the
# target, the growth cap and the LR rules, without the efficiency bound.
TARGET_ONLY = {"min_efficiency": None, "may_shrink": False}


def drive(schedule, epochs, noise_scales, *, steps=40, **engine):
    """The driver's loop: ask for phases until the fit's epochs are covered, feeding
    back one measured noise scale per finished phase (None: nothing measured), each
    phase of ``steps`` steps, all measured (the tracker's count, cumulative)."""
    out, epoch, previous, measured, total = [], 0, None, None, 0
    noise = iter(noise_scales)
    while epoch < epochs:
        previous = schedule.next_phase(
            start_epoch=epoch, total_epochs=epochs, previous=previous, measured=measured, **engine
        )
        out.append(previous)
        epoch = previous.end_epoch
        total += steps
        measured = PhaseMeasurement(
            noise_scale=next(noise, None), steps=steps, measured_steps=total
        )
    return out


def test_phases_chain_over_a_whole_fit():
    schedule = Adaptive(32, max_batch=4096, epochs_per_phase=3)
    phases = drive(schedule, 10, [1e6] * 10)
    assert [p.index for p in phases] == [0, 1, 2, 3]
    assert [(p.start_epoch, p.end_epoch) for p in phases] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [p.global_batch for p in phases] == [32, 64, 128, 256]  # ×2 per phase at most
    assert phases[0].noise_scale is None and phases[0].gain == 1.0
    assert [p.noise_scale for p in phases[1:]] == [1e6] * 3


def test_counting_progress_phases_keep_their_length_and_the_last_reaches_the_progress():
    """Adaptive(scale_invariant=True): phases stay epochs_per_phase epochs of data; each
    makes r*B0/B epochs of progress per epoch (r: AdaScale's gain at the estimate it was
    chosen from); the last is cut to the whole epochs that reach the fit's progress, and
    then there is no phase left."""
    schedule = Adaptive(16, max_batch=64, epochs_per_phase=2, scale_invariant=True, **TARGET_ONLY)
    assert schedule.counts_progress and not Adaptive(16, max_batch=64).counts_progress
    out, epoch, previous, measured = [], 0, None, None
    while (phase := schedule.next_phase(
        start_epoch=epoch, total_epochs=5, previous=previous, measured=measured
    )) is not None:  # fmt: skip
        out.append(phase)
        epoch, previous = phase.end_epoch, phase
        measured = PhaseMeasurement(noise_scale=48.0, steps=40, measured_steps=40 * len(out))
    assert [p.global_batch for p in out] == [16, 32, 48, 48]  # x2, then target x 48
    per_epoch = [1.0] + [adascale_gain(48.0, 16, b) * 16 / b for b in (32, 48, 48)]
    # progress 0 -> 2 (2 epochs at B0), -> 2 + 2 x 0.8, -> +2 x 0.67; the last needs
    # (5 - 4.93) / 0.67 -> 1 epoch of data, cut from the phase's 2
    assert [(p.start_epoch, p.end_epoch) for p in out] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    ends = list(itertools.accumulate(
        e * r for e, r in zip((2, 2, 2, 1), per_epoch, strict=True)
    ))  # fmt: skip
    assert [p.progress_end for p in out] == pytest.approx(ends)
    assert out[-1].progress_end >= 5 > out[-2].progress_end
    # the LR rule does not change the progress counted: the gain, not the LR scale
    root = Adaptive(16, max_batch=64, lr_rule="sqrt", scale_invariant=True, **TARGET_ONLY)
    second = root.next_phase(
        start_epoch=1, total_epochs=5, previous=root.next_phase(
            start_epoch=0, total_epochs=5, previous=None
        ), measured=PhaseMeasurement(noise_scale=48.0, steps=40, measured_steps=40),
    )  # fmt: skip
    assert second.lr_scale == pytest.approx(2**0.5)
    assert second.progress_end - second.progress_start == pytest.approx(per_epoch[1])


def test_batch_follows_target_times_noise_scale_within_bounds():
    schedule = Adaptive(100, max_batch=1000, max_growth=3.0, target=0.5, **TARGET_ONLY)
    # 0.5 × 500 = 250 is within [100, 300]: taken as is.
    assert [p.global_batch for p in drive(schedule, 2, [500.0])] == [100, 250]
    # 0.5 × 100 = 50 is below the current batch: the batch never shrinks.
    assert [p.global_batch for p in drive(schedule, 3, [500.0, 100.0])] == [100, 250, 250]
    # Growth capped at 3× per phase, then at max_batch.
    assert [p.global_batch for p in drive(schedule, 4, [1e9] * 3)] == [100, 300, 900, 1000]


def test_keeps_the_batch_without_an_estimate():
    schedule = Adaptive(64, max_batch=1024, lr_rule="adascale")
    phases = drive(schedule, 4, [400.0, None, None])
    assert [p.global_batch for p in phases] == [64, 128, 128, 128]
    assert [p.noise_scale for p in phases] == [None, 400.0, None, None]
    # Without a new estimate, AdaScale keeps the last gain.
    assert phases[2].lr_scale == phases[3].lr_scale == phases[1].lr_scale
    # No measurement object at all (e.g. the driver measured nothing) is the same.
    second = schedule.next_phase(start_epoch=1, total_epochs=4, previous=phases[0])
    assert second.global_batch == 64 and second.lr_scale == 1.0


def test_batch_multiple_rounds_down_but_never_below_the_current_batch():
    schedule = Adaptive(96, max_batch=1000, batch_multiple=32, confirm_growth=False)
    # 150 → 128; then 2 × 128 = 256 is a multiple; then 1000 caps → 992 (multiple of 32).
    assert [p.global_batch for p in drive(schedule, 3, [150.0, 1e9])] == [96, 128, 256]
    assert [p.global_batch for p in drive(schedule, 6, [1e9] * 5)][-1] == 992
    # 100 rounds down to 96, the current batch: kept.
    assert [p.global_batch for p in drive(schedule, 2, [100.0])] == [96, 96]


@given(
    initial=st.integers(1, 512),
    extra=st.integers(0, 5000),
    growth=st.floats(1.0, 4.0),
    multiple=st.sampled_from([1, 2, 8]),
    noise=st.lists(st.one_of(st.none(), st.floats(0.0, 1e7)), max_size=12),
)
def test_growth_is_bounded_monotone_and_capped(initial, extra, growth, multiple, noise):
    initial = initial * multiple
    schedule = Adaptive(
        initial,
        max_batch=initial + extra,
        max_growth=growth,
        batch_multiple=multiple,
        **TARGET_ONLY,
    )
    batches = [p.global_batch for p in drive(schedule, len(noise) + 1, noise)]
    assert batches[0] == initial
    earlier = [None, *noise]  # the estimate the phase before was chosen from
    for (before, after), measured, prior in zip(
        itertools.pairwise(batches), noise, earlier, strict=False
    ):
        ceiling = min(before * growth, initial + extra)
        assert before <= after <= max(before, ceiling)
        assert after == before or after % multiple == 0
        if measured is None:
            assert after == before
        else:  # as close to the (confirmed) noise scale as the bounds and rounding allow
            wanted = measured if prior is None else min(measured, prior)
            assert after > min(wanted, ceiling) - multiple or after == before
    assert max(batches) <= schedule.max_batch() == initial + extra


def test_lr_rules():
    noise = [1e9, 1e9, 1e9]  # noise dominates: AdaScale scales linearly
    adascale = drive(Adaptive(32, max_batch=1024, **TARGET_ONLY), 4, noise)
    assert [p.global_batch for p in adascale] == [32, 64, 128, 256]
    assert [p.lr_scale for p in adascale] == pytest.approx([1, 2, 4, 8], rel=1e-6)
    assert [p.gain for p in adascale] == [p.lr_scale for p in adascale]
    # A moderate noise scale: the gain from the estimate, relative to the initial batch.
    moderate = drive(Adaptive(32, max_batch=1024, max_growth=4.0, **TARGET_ONLY), 2, [100.0])
    assert moderate[1].global_batch == 100
    assert moderate[1].lr_scale == pytest.approx(adascale_gain(100.0, 32, 100))
    assert 1 < moderate[1].lr_scale < 100 / 32
    linear = drive(Adaptive(32, max_batch=1024, lr_rule="linear", lr=0.1, **TARGET_ONLY), 4, noise)
    assert [p.lr_scale for p in linear] == [1.0, 2.0, 4.0, 8.0]
    assert [p.lr for p in linear] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    sqrt = drive(Adaptive(32, max_batch=1024, lr_rule="sqrt", **TARGET_ONLY), 3, noise)
    assert [p.lr_scale for p in sqrt] == pytest.approx([1.0, 2**0.5, 2.0])
    capped = drive(
        Adaptive(32, max_batch=1024, lr_rule="linear", max_lr_scale=3.0, **TARGET_ONLY), 4, noise
    )
    assert [p.lr_scale for p in capped] == [1.0, 2.0, 3.0, 3.0]
    assert [p.global_batch for p in capped] == [32, 64, 128, 256]  # the batch is not capped
    capped_ada = drive(Adaptive(32, max_batch=1024, max_lr_scale=3.0, **TARGET_ONLY), 4, noise)
    assert [p.lr_scale for p in capped_ada] == pytest.approx([1.0, 2.0, 3.0, 3.0])
    assert {
        p.lr_scale
        for p in drive(Adaptive(32, max_batch=64, lr_rule="none", **TARGET_ONLY), 2, noise)
    } == {1.0}


def test_adascale_sqrt_rule_is_the_square_root_of_the_gain():
    # Noise dominates: AdaScale is linear, its square root the sqrt rule.
    noise = [1e9, 1e9, 1e9]
    phases = drive(Adaptive(32, max_batch=1024, lr_rule="adascale-sqrt", **TARGET_ONLY), 4, noise)
    assert [p.global_batch for p in phases] == [32, 64, 128, 256]
    assert [p.lr_scale for p in phases] == pytest.approx([1, 2**0.5, 2, 8**0.5], rel=1e-6)
    assert [p.gain for p in phases] == [p.lr_scale for p in phases]
    # A moderate noise scale: sqrt of AdaScale's gain, between 1 and sqrt(B/B0).
    moderate = drive(
        Adaptive(32, max_batch=1024, max_growth=4.0, lr_rule="adascale-sqrt", **TARGET_ONLY),
        2,
        [100.0],
    )
    assert moderate[1].lr_scale == pytest.approx(adascale_gain(100.0, 32, 100) ** 0.5)
    assert 1 < moderate[1].lr_scale < (100 / 32) ** 0.5
    # No noise: no gain; no estimate: the previous scale is kept; the cap applies.
    quiet = Adaptive(32, max_batch=1024, lr_rule="adascale-sqrt", **TARGET_ONLY)
    assert quiet.lr_scale(64, 0.0) == 1.0
    assert quiet.lr_scale(64, None, previous=1.3) == 1.3
    capped = Adaptive(32, max_batch=1024, lr_rule="adascale-sqrt", max_lr_scale=1.5, **TARGET_ONLY)
    assert capped.lr_scale(1024, 1e9) == 1.5


def test_confirm_growth_follows_a_rise_only_once_two_phases_measured_it():
    schedule = Adaptive(16, max_batch=1024, confirm_growth=True, **TARGET_ONLY)
    # The first estimate is acted on alone (there is no earlier one).
    assert [p.global_batch for p in drive(schedule, 2, [24.0])] == [16, 24]
    # A one-phase spike (500) is not followed: min(500, 30) = 30; a lasting rise is.
    batches = [p.global_batch for p in drive(schedule, 5, [30.0, 500.0, 40.0, 300.0])]
    assert batches == [16, 30, 30, 40, 40]
    rising = [p.global_batch for p in drive(schedule, 5, [40.0, 200.0, 200.0, 200.0])]
    assert rising == [16, 32, 40, 80, 160]
    # The LR gain still uses the latest estimate at the chosen batch.
    phases = drive(schedule, 3, [30.0, 500.0])
    assert phases[2].lr_scale == pytest.approx(adascale_gain(500.0, 16, 30))
    assert phases[2].noise_scale == 500.0
    # Without confirmation (the default) each estimate is followed at once.
    eager = Adaptive(16, max_batch=1024, **TARGET_ONLY)
    assert [p.global_batch for p in drive(eager, 3, [30.0, 500.0])] == [16, 30, 60]
    with pytest.raises(dfl.ConfigError, match="confirm_growth"):
        Adaptive(16, max_batch=1024, confirm_growth=1, **TARGET_ONLY)


def test_min_efficiency_bounds_the_batch_by_progress_per_sample():
    schedule = Adaptive(16, max_batch=4096, max_growth=100.0, min_efficiency=0.8)
    # (B0 + Bn)/(B + Bn) >= 0.8  <=>  B <= (16 + Bn)/0.8 - Bn = 20 + Bn/4
    for noise, bound in ((0.0, 20.0), (80.0, 40.0), (400.0, 120.0)):
        assert schedule.efficient_batch(noise) == pytest.approx(bound)
        batch = schedule.next_batch(16, noise)
        assert batch == max(16, min(int(bound), int(noise)))
        gain = adascale_gain(noise, 16, batch)
        assert gain * 16 / batch >= 0.8 - 1e-9  # the progress per sample kept
    # The target still caps it from above.
    capped = Adaptive(16, max_batch=4096, max_growth=4.0, target=0.1, min_efficiency=0.8)
    assert capped.next_batch(16, 400.0) == 40
    # 1.0: no loss allowed, no growth; None: the target alone (the old rule).
    assert Adaptive(16, max_batch=4096, min_efficiency=1.0).next_batch(16, 1e6) == 16
    free = Adaptive(16, max_batch=4096, max_growth=100.0, min_efficiency=None)
    assert free.next_batch(16, 400.0) == 400 and free.efficient_batch(400.0) == float("inf")
    for bad in (0.0, 1.5, -0.2, float("nan"), "0.8"):
        with pytest.raises(dfl.ConfigError, match="min_efficiency"):
            Adaptive(16, max_batch=64, min_efficiency=bad)


def test_defaults_bound_by_efficiency_and_may_shrink():
    schedule = Adaptive(16, max_batch=512)
    assert schedule.min_efficiency == 0.8 and schedule.may_shrink is True
    assert schedule.lr_rule == "adascale" and schedule.confirm_growth is False
    # noise dominates: doubling per phase up to 1.25 B0 + B_noise/4
    phases = drive(schedule, 6, [2000.0] * 5)
    assert [p.global_batch for p in phases] == [16, 32, 64, 128, 256, 512]
    # B_noise = 200: at most 20 + 50 = 70
    assert [p.global_batch for p in drive(schedule, 4, [200.0] * 3)] == [16, 32, 64, 70]


def test_may_shrink_follows_a_falling_noise_scale_down_to_the_initial_batch():
    schedule = Adaptive(16, max_batch=4096, min_efficiency=0.8, may_shrink=True)
    assert schedule.efficiency(16, 80.0) == 1.0
    assert schedule.efficiency(64, 80.0) == pytest.approx(96 / 144)
    # at 64, the noise scale falls to 80: the bound 20 + 80/4 = 40, reached in one phase
    assert schedule.next_batch(64, 80.0) == 40
    # at most ÷max_growth per phase, never below initial_batch
    assert schedule.next_batch(256, 0.0) == 128
    assert schedule.next_batch(20, 0.0) == 16
    # no estimate: kept
    assert schedule.next_batch(64, None) == 64
    # a multiple: rounded up, never above the current batch
    multiple = Adaptive(32, max_batch=4096, batch_multiple=32, min_efficiency=0.8, may_shrink=True)
    assert multiple.next_batch(128, 5.0) == 64
    assert multiple.next_batch(64, 100.0) == 64  # 40 + 25 = 65 rounds down to 64: kept
    phases = drive(schedule, 6, [400.0, 400.0, 400.0, 8.0, 8.0])
    assert [p.global_batch for p in phases] == [16, 32, 64, 120, 60, 30]
    # the LR follows the batch both ways (AdaScale's gain at the chosen batch)
    assert phases[-1].lr_scale == pytest.approx(adascale_gain(8.0, 16, 30))
    # off: the batch never shrinks
    keep = Adaptive(16, max_batch=4096, min_efficiency=0.8, may_shrink=False)
    assert keep.next_batch(64, 0.0) == 64
    with pytest.raises(dfl.ConfigError, match="may_shrink"):
        Adaptive(16, max_batch=64, may_shrink="yes")


def test_warmup_applies_after_the_first_phase():
    phases = drive(Adaptive(8, max_batch=64, warmup_steps=5), 3, [1e9, 1e9])
    assert [p.warmup_steps for p in phases] == [0, 5, 5]


def test_measures_noise_flags_and_protocol():
    adaptive = Adaptive(8, max_batch=64)
    assert Adaptive.measures_noise and adaptive.measures_noise
    assert not Fixed.measures_noise and not Stepwise({0: 8}, lr_scaling="linear").measures_noise
    assert Stepwise({0: 8, 1: 16}).measures_noise  # the default rule: its LR from the noise
    for schedule in (adaptive, Fixed(8), Stepwise({0: 8})):
        assert isinstance(schedule, Schedule)

    class Minimal:  # a user's schedule written before measures_noise existed
        def next_phase(self, *, start_epoch, total_epochs, previous, measured=None):
            return PhaseSpec(index=0, start_epoch=0, end_epoch=total_epochs, global_batch=8)

        def max_batch(self):
            return 8

    assert isinstance(Minimal(), Schedule)
    assert adaptive.max_batch() == 64
    assert "max_batch=64" in repr(adaptive)
    same = pickle.loads(pickle.dumps(adaptive))  # travels to workers / checkpoints
    assert same == adaptive and same.max_batch() == 64


def test_phase_spec_and_measurement_validate():
    with pytest.raises(dfl.ConfigError, match="gain must be > 0"):
        PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=8, gain=0.0)
    with pytest.raises(dfl.ConfigError, match="noise_scale must be >= 0"):
        PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=8, noise_scale=-1.0)
    with pytest.raises(dfl.ConfigError, match="noise_scale must be >= 0 or None"):
        PhaseMeasurement(noise_scale=float("nan"))
    with pytest.raises(dfl.ConfigError, match="samples_per_second must be >= 0"):
        PhaseMeasurement(samples_per_second=-1.0)
    with pytest.raises(dfl.ConfigError, match="steps must be an int >= 0"):
        PhaseMeasurement(steps=-1)
    with pytest.raises(dfl.ConfigError, match="measured_steps must be an int >= 0"):
        PhaseMeasurement(measured_steps=-1)
    assert PhaseMeasurement(gradient_sq=-3.0).gradient_sq == -3.0  # a negative estimate is data


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial_batch": 0}, dfl.BatchSizeError, "initial_batch must be a positive int"),
        ({"max_batch": 16}, dfl.BatchSizeError, "max_batch must be >= initial_batch"),
        ({"max_batch": 64.0}, dfl.BatchSizeError, "max_batch must be a positive int"),
        ({"batch_multiple": 0}, dfl.BatchSizeError, "batch_multiple must be a positive int"),
        ({"batch_multiple": 12}, dfl.BatchSizeError, r"multiple of batch_multiple.*Adaptive\(24"),
        ({"epochs_per_phase": 0}, dfl.ConfigError, "epochs_per_phase=0"),
        ({"max_growth": 0.5}, dfl.ConfigError, "max_growth=0.5.*must be >= 1"),
        ({"max_growth": float("inf")}, dfl.ConfigError, "max_growth=inf.*finite"),
        ({"target": 0}, dfl.ConfigError, "target=0.*must be > 0"),
        ({"lr_rule": "cubic"}, dfl.ConfigError, r"lr_rule='cubic'.*'adascale'"),
        ({"lr": -0.1}, dfl.ConfigError, "lr=-0.1"),
        ({"warmup_steps": -1}, dfl.ConfigError, "warmup_steps=-1"),
        ({"max_lr_scale": 0.5}, dfl.ConfigError, "max_lr_scale=0.5.*>= 1"),
        ({"steps_per_phase": 0}, dfl.ConfigError, "steps_per_phase=0.*>= 1"),
        ({"steps_per_phase": 2.5}, dfl.ConfigError, r"steps_per_phase=2.5.*int >= 1"),
        ({"steps_per_phase": True}, dfl.ConfigError, "steps_per_phase=True"),
        (
            {"steps_per_phase": 50, "epochs_per_phase": 2},
            dfl.ConfigError,
            "one way, in epochs or in steps",
        ),
        ({"steps_per_phase": 50, "samples_per_epoch": 0}, dfl.ConfigError, "samples_per_epoch=0"),
        ({"samples_per_epoch": 1000}, dfl.ConfigError, "give steps_per_phase=... too"),
        ({"min_measured_steps": -1}, dfl.ConfigError, "min_measured_steps=-1.*int >= 0"),
        ({"min_measured_steps": 2.0}, dfl.ConfigError, "min_measured_steps=2.0"),
        ({"measure_every": 0}, dfl.ConfigError, r"measure_every=0.*'auto' or an int >= 1"),
        ({"measure_every": "often"}, dfl.ConfigError, "measure_every='often'"),
        ({"measure_every": True}, dfl.ConfigError, "measure_every=True"),
        ({"measure_every": 2.0}, dfl.ConfigError, "measure_every=2.0"),
        ({"scale_invariant": 1}, dfl.ConfigError, "scale_invariant=1.*True or False"),
    ],
)
def test_adaptive_validates_every_field(kwargs, error, match):
    args = {"initial_batch": 32, "max_batch": 256} | kwargs
    with pytest.raises(error, match=match):
        Adaptive(args.pop("initial_batch"), **args)


# -- phase length in steps --------------------------------------------------------------


def test_steps_per_phase_spans_the_fewest_whole_epochs_holding_n_steps():
    schedule = Adaptive(32, max_batch=256, steps_per_phase=100, samples_per_epoch=1000)
    phases = drive(schedule, 30, [1e9] * 10)
    # B=32: ceil(1000/32) = 32 steps an epoch, 4 epochs hold 128 >= 100 (3 hold 96);
    # B=64: 16 an epoch -> 7 epochs (112); B=128: 8 -> 13 epochs (104); cut at epoch 30.
    assert [p.global_batch for p in phases] == [32, 64, 128, 256]
    assert [(p.start_epoch, p.end_epoch) for p in phases] == [(0, 4), (4, 11), (11, 24), (24, 30)]
    assert "steps_per_phase=100" in repr(schedule)
    assert pickle.loads(pickle.dumps(schedule)) == schedule


def test_steps_per_phase_from_the_engines_epoch_size_and_drop_last():
    schedule = Adaptive(32, max_batch=32, steps_per_phase=94)
    assert schedule.needs_epoch_size
    assert not Adaptive(32, max_batch=32, steps_per_phase=94, samples_per_epoch=9).needs_epoch_size
    assert not Adaptive(32, max_batch=32).needs_epoch_size
    # 1000 samples at 32: 32 steps an epoch with the short last step (3 epochs = 96 >= 94),
    # 31 without it (drop_last: 3 epochs = 93 < 94, so 4).
    kept = drive(schedule, 12, [], num_samples=1000)
    dropped = drive(schedule, 12, [], num_samples=1000, drop_last=True)
    assert [p.end_epoch - p.start_epoch for p in kept] == [3, 3, 3, 3]
    assert [p.end_epoch - p.start_epoch for p in dropped] == [4, 4, 4]
    # An epoch longer than the phase: one epoch; samples_per_epoch wins over the engine's.
    assert drive(schedule, 3, [], num_samples=10_000)[0].end_epoch == 1
    explicit = Adaptive(32, max_batch=32, steps_per_phase=94, samples_per_epoch=64)
    assert drive(explicit, 100, [], num_samples=10_000)[0].end_epoch == 47  # 2 steps an epoch
    with pytest.raises(dfl.ConfigError, match="pass samples_per_epoch="):
        schedule.next_phase(start_epoch=0, total_epochs=5, previous=None)


@given(
    n=st.integers(1, 5000),
    initial=st.integers(1, 64),
    steps=st.integers(1, 400),
    drop_last=st.booleans(),
)
def test_steps_per_phase_is_the_smallest_sufficient_whole_number_of_epochs(
    n, initial, steps, drop_last
):
    from dataflow.io.sampler import steps_per_epoch

    schedule = Adaptive(initial, max_batch=initial * 8, steps_per_phase=steps)
    for batch in (initial, initial * 2, initial * 8):
        epochs = schedule.phase_epochs(batch, n, drop_last)
        per_epoch = steps_per_epoch(n, batch, drop_last=drop_last)
        if per_epoch == 0:  # a batch beyond the data: the engine refuses it; one epoch here
            assert epochs == 1
            continue
        assert epochs * per_epoch >= steps
        assert epochs == 1 or (epochs - 1) * per_epoch < steps


def test_epochs_per_phase_default_is_one_epoch():
    assert [(p.start_epoch, p.end_epoch) for p in drive(Adaptive(8, max_batch=8), 3, [])] == [
        (0, 1),
        (1, 2),
        (2, 3),
    ]


# -- a minimum of measured steps before the estimate is trusted --------------------------


def test_an_estimate_from_too_few_steps_keeps_the_batch_and_the_lr():
    schedule = Adaptive(16, max_batch=256, min_measured_steps=20)
    # 8 measured steps a phase, cumulative: 8, 16, 24, 32.
    phases = drive(schedule, 5, [5000.0, 5000.0, 5000.0, 5000.0], steps=8)
    assert [p.global_batch for p in phases] == [16, 16, 16, 32, 64]
    assert [p.noise_scale for p in phases] == [None, None, None, 5000.0, 5000.0]
    assert [p.lr_scale for p in phases[:3]] == [1.0, 1.0, 1.0]
    assert phases[3].lr_scale == pytest.approx(adascale_gain(5000.0, 16, 32))
    # min_measured_steps=0 trusts any estimate (the behaviour before the guard).
    eager = drive(Adaptive(16, max_batch=256, min_measured_steps=0), 3, [5000.0] * 2, steps=1)
    assert [p.global_batch for p in eager] == [16, 32, 64]
    assert Adaptive(16, max_batch=256).min_measured_steps == 20  # the default


def test_measured_steps_not_reported_counts_the_first_phases_steps():
    schedule = Adaptive(16, max_batch=256)
    first = schedule.next_phase(start_epoch=0, total_epochs=9, previous=None)
    few = PhaseMeasurement(noise_scale=5000.0, steps=12)  # no measured_steps
    many = PhaseMeasurement(noise_scale=5000.0, steps=30)
    assert (
        schedule.next_phase(
            start_epoch=1, total_epochs=9, previous=first, measured=few
        ).global_batch
        == 16
    )
    second = schedule.next_phase(start_epoch=1, total_epochs=9, previous=first, measured=many)
    assert second.global_batch == 32
    # After the first phase an unreported count is unknown: the estimate is used.
    assert (
        schedule.next_phase(
            start_epoch=2, total_epochs=9, previous=second, measured=few
        ).global_batch
        == 64
    )
    # A reported count wins over the phase's steps.
    reported = PhaseMeasurement(noise_scale=5000.0, steps=30, measured_steps=10)
    assert (
        schedule.next_phase(
            start_epoch=1, total_epochs=9, previous=first, measured=reported
        ).global_batch
        == 16
    )


# -- how often the noise is measured ------------------------------------------------------


def test_measure_every_auto_keeps_enough_measured_steps_per_phase():
    """By default ("auto") every step of a phase under 120 steps is measured, and every
    k-th step of a longer one with k = phase steps // 60: at least 60 measured steps, where
    the tracker's EMA is within 10 % of the variance of measuring every step."""
    auto = Adaptive(8, max_batch=64)
    assert auto.measure_every == "auto" and "measure_every='auto'" in repr(auto)
    lengths = (1, 24, 119, 120, 179, 180, 600, 6000)
    assert [auto.measure_interval(s) for s in lengths] == [1, 1, 1, 2, 2, 3, 10, 100]
    for steps in range(1, 2000, 7):
        k = auto.measure_interval(steps)
        measured = len(range(0, steps, k))
        assert measured == steps or measured >= 60
    fixed_k = Adaptive(8, max_batch=64, measure_every=4)
    assert [fixed_k.measure_interval(s) for s in (1, 24, 6000)] == [4, 4, 4]
    assert "measure_every=4" in repr(fixed_k)


def test_steps_measured_are_every_kth_of_the_fit_by_index():
    from dataflow.core.step import PhaseContext
    from dataflow.driver.segments import Planner

    phase = PhaseContext(index=1, steps=(), lr=None, measure_noise=True, measure_every=3)
    assert [i for i in range(10, 20) if phase.measures(i)] == [12, 15, 18]
    assert not PhaseContext(index=0, steps=(), lr=None, measure_every=3).measures(0)
    assert PhaseContext(index=0, steps=(), lr=None, measure_noise=True).measures(7)

    def planner(schedule):
        noise = schedule.measures_noise
        return Planner(schedule=schedule, balancer=None, num_samples=1, measures_noise=noise)

    assert planner(Adaptive(8, max_batch=64)).measure_every(600) == 10
    assert planner(Adaptive(8, max_batch=64, measure_every=5)).measure_every(24) == 5
    assert planner(Fixed(8)).measure_every(600) == 1


def test_one_replica_splits_only_the_steps_it_measures():
    """Measuring the noise with one replica takes two micro-batches of a step; the steps
    between measurements run whole (half batches cost a GPU nearly a whole step more)."""
    from dataflow.driver.segments import Planner
    from dataflow.schedule.balance import Even

    planner = Planner(
        schedule=Adaptive(8, max_batch=8, measure_every=3, epochs_per_phase=2),
        balancer=Even(),
        num_samples=64,
        measures_noise=True,
    )
    phase = planner.next_phase(start_epoch=0, total_epochs=2, previous=None)
    steps = planner.phase_steps(phase, replicas=1, first_index=0)
    assert len(steps) == 16
    assert [s.micro_batches for s in steps] == [(2,) if s.index % 3 == 0 else (1,) for s in steps]
    # after a lost worker the rest of the phase keeps the phase's cadence
    rest = planner.rest(steps, commit=5, replicas=1, phase_steps=len(steps))
    assert [s.micro_batches for s in rest] == [(2,) if s.index % 3 == 0 else (1,) for s in rest]
    # two replicas measure across replicas: no step is split
    assert {s.micro_batches for s in planner.phase_steps(phase, 2, 0)} == {(1, 1)}
    every_step = Planner(
        schedule=Adaptive(8, max_batch=8, epochs_per_phase=2),  # "auto": every step of 16
        balancer=Even(),
        num_samples=64,
        measures_noise=True,
    )
    assert {s.micro_batches for s in every_step.phase_steps(phase, 1, 0)} == {(2,)}
