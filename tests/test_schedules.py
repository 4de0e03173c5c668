"""Schedules and the speed-aware balancer: pure, no cluster."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.schedule import Fixed, PhaseMeasurement, Stepwise, lr_at
from dataflow.schedule.balance import Throughput, smoothed_speeds


def phases(schedule, epochs):
    out, epoch, previous = [], 0, None
    while epoch < epochs:
        previous = schedule.next_phase(start_epoch=epoch, total_epochs=epochs, previous=previous)
        out.append(previous)
        epoch = previous.end_epoch
    return out


def test_stepwise_phases_batches_and_lr_rules():
    table = {0: 16, 2: 64, 5: 128, 9: 256}
    linear = phases(Stepwise(table, lr_scaling="linear", warmup_steps=3), 7)
    assert [(p.start_epoch, p.end_epoch, p.global_batch) for p in linear] == [
        (0, 2, 16),
        (2, 5, 64),
        (5, 7, 128),
    ]
    assert [p.lr_scale for p in linear] == [1.0, 4.0, 8.0]
    assert [p.warmup_steps for p in linear] == [0, 3, 3]  # no ramp into the first phase
    assert [p.lr_scale for p in phases(Stepwise(table, lr_scaling="sqrt"), 7)] == [1.0, 2.0, 8**0.5]
    assert {p.lr_scale for p in phases(Stepwise(table, lr_scaling="none"), 7)} == {1.0}
    assert [p.lr for p in phases(Stepwise(table, lr_scaling="linear", lr=0.1), 3)] == [0.1, 0.4]
    assert Stepwise(table).max_batch() == 256


def test_stepwise_validates_its_table():
    with pytest.raises(dfl.ConfigError, match="needs the batch for epoch 0"):
        Stepwise({3: 64})
    with pytest.raises(dfl.ConfigError, match="key '3' is not an epoch"):
        Stepwise({0: 8, "3": 64})
    with pytest.raises(dfl.BatchSizeError, match="the batch at epoch 2 must be a positive int"):
        Stepwise({0: 8, 2: 0})
    every_rule = r"\['linear', 'none', 'sqrt', 'adascale', 'adascale-sqrt'\]"
    with pytest.raises(dfl.ConfigError, match=rf"lr_scaling='cubic'.*{every_rule}"):
        Stepwise({0: 8}, lr_scaling="cubic")
    with pytest.raises(dfl.BatchSizeError, match="epochs_per_phase must be a positive int"):
        Fixed(8, epochs_per_phase=0)


def measured_after(steps: int, noise_scale: float | None) -> PhaseMeasurement:
    return PhaseMeasurement(noise_scale=noise_scale, steps=steps, measured_steps=steps)


def test_stepwise_adascale_takes_each_phase_lr_from_the_noise_measured_before_it():
    """The user's batches; each LR scale is AdaScale's gain at the estimate the phase
    began with: linear in B/B0 when the noise dominates, near 1 when B >> B_noise, and
    it may fall from one phase to the next as the noise scale does."""
    table = {0: 16, 2: 64, 4: 256}
    schedule = Stepwise(table, lr_scaling="adascale", warmup_steps=2, lr=0.1)
    assert schedule.measures_noise
    first = schedule.next_phase(start_epoch=0, total_epochs=6, previous=None)
    assert (first.global_batch, first.lr_scale, first.gain, first.noise_scale) == (16, 1, 1, None)
    second = schedule.next_phase(
        start_epoch=2, total_epochs=6, previous=first, measured=measured_after(40, 48.0)
    )
    gain = (1 + 48 / 16) / (1 + 48 / 64)  # 2.29, between 1 and the linear rule's 4
    assert second.global_batch == 64 and second.warmup_steps == 2
    assert (second.lr_scale, second.gain, second.noise_scale) == pytest.approx((gain, gain, 48.0))
    assert second.lr == pytest.approx(0.1 * gain)
    third = schedule.next_phase(
        start_epoch=4, total_epochs=6, previous=second, measured=measured_after(60, 4.0)
    )
    assert third.global_batch == 256
    assert third.lr_scale == pytest.approx((1 + 4 / 16) / (1 + 4 / 256))
    assert third.lr_scale < second.lr_scale
    # the bounds: no noise, the same LR; all noise, the linear rule
    for noise, scale in ((0.0, 1.0), (1e12, 4.0)):
        phase = schedule.next_phase(
            start_epoch=2, total_epochs=6, previous=first, measured=measured_after(40, noise)
        )
        assert phase.lr_scale == pytest.approx(scale)
    root = Stepwise(table, lr_scaling="adascale-sqrt").next_phase(
        start_epoch=2, total_epochs=6, previous=first, measured=measured_after(40, 48.0)
    )
    assert root.lr_scale == pytest.approx(gain**0.5) and root.gain == root.lr_scale


def test_stepwise_adascale_keeps_the_last_lr_scale_until_an_estimate_is_trusted():
    schedule = Stepwise({0: 16, 1: 64, 2: 256}, lr_scaling="adascale", min_measured_steps=30)
    first = schedule.next_phase(start_epoch=0, total_epochs=3, previous=None)
    for measured in (None, measured_after(29, 48.0), measured_after(40, None)):
        second = schedule.next_phase(
            start_epoch=1, total_epochs=3, previous=first, measured=measured
        )
        assert (second.global_batch, second.lr_scale, second.noise_scale) == (64, 1.0, None)
    # a trusted estimate of |G|^2 that is not positive: the noise dominates, so the gain
    # is the linear rule's (and the history records no noise scale, as the tracker has none)
    drowned = PhaseMeasurement(gradient_sq=-0.2, trace_cov=5.0, steps=40, measured_steps=40)
    linear = schedule.next_phase(start_epoch=1, total_epochs=3, previous=first, measured=drowned)
    assert (linear.lr_scale, linear.gain, linear.noise_scale) == (4.0, 4.0, None)
    early = PhaseMeasurement(gradient_sq=-0.2, trace_cov=5.0, steps=29, measured_steps=29)
    kept = schedule.next_phase(start_epoch=1, total_epochs=3, previous=first, measured=early)
    assert kept.lr_scale == 1.0
    trusted = schedule.next_phase(
        start_epoch=1, total_epochs=3, previous=first, measured=measured_after(30, 48.0)
    )
    assert trusted.lr_scale > 1
    third = schedule.next_phase(start_epoch=2, total_epochs=3, previous=trusted, measured=None)
    assert third.lr_scale == trusted.lr_scale and third.global_batch == 256


def test_stepwise_measures_the_noise_only_for_the_adascale_rules():
    assert Stepwise({0: 8}, lr_scaling="adascale").measure_interval(600) == 10  # 60 a phase
    assert Stepwise({0: 8}, lr_scaling="adascale").measure_interval(30) == 1
    assert Stepwise({0: 8}, lr_scaling="adascale", measure_every=4).measure_interval(600) == 4
    for rule in ("linear", "sqrt", "none"):
        assert not Stepwise({0: 8, 1: 16}, lr_scaling=rule).measures_noise
    # a table of one batch never changes its LR: nothing to measure (one replica would
    # split every step in two to measure)
    constant = Stepwise({0: 8, 3: 8})
    assert not constant.measures_noise
    assert {p.lr_scale for p in phases(constant, 5)} == {1.0}
    with pytest.raises(dfl.ConfigError, match=r"measure_every=0\): must be 'auto' or an int"):
        Stepwise({0: 8}, lr_scaling="adascale", measure_every=0)
    with pytest.raises(dfl.ConfigError, match=r"min_measured_steps=-1\): must be an int >= 0"):
        Stepwise({0: 8}, lr_scaling="adascale", min_measured_steps=-1)
    with pytest.raises(dfl.ConfigError, match="only for lr_scaling='adascale'"):
        Stepwise({0: 8}, lr_scaling="linear", measure_every=4)


def progress_phases(schedule, epochs, measured):
    """The phases of a fit counting progress, each chosen with ``measured`` (None at
    first), until the schedule has none left."""
    out, epoch, previous = [], 0, None
    while (phase := schedule.next_phase(
        start_epoch=epoch, total_epochs=epochs, previous=previous,
        measured=None if previous is None else measured,
    )) is not None:  # fmt: skip
        out.append(phase)
        epoch, previous = phase.end_epoch, phase
        assert len(out) < 20, "the schedule never ends"
    return out


def test_scale_invariant_stepwise_runs_each_phase_until_its_progress_is_made():
    """Counting progress, a phase at batch B with gain r makes r*B0/B epochs of progress
    per epoch of data: it runs the whole epochs that reach the table's next entry, and
    the fit ends once the asked-for progress is made."""
    schedule = Stepwise({0: 16, 2: 64, 4: 256}, scale_invariant=True, lr=0.1)
    assert schedule.counts_progress and not Stepwise({0: 16, 2: 64}).counts_progress
    got = progress_phases(schedule, 6, measured_after(40, 48.0))
    gains = [1.0, (1 + 48 / 16) / (1 + 48 / 64), (1 + 48 / 16) / (1 + 48 / 256)]
    per_epoch = [g * 16 / b for g, b in zip(gains, (16, 64, 256), strict=True)]  # 1, .57, .22
    assert [p.global_batch for p in got] == [16, 64, 256]
    assert [p.lr_scale for p in got] == pytest.approx(gains)  # the LR is AdaScale's as ever
    # phase 0: 2 epochs at B0; phase 1: 2 epochs of progress at 0.57 an epoch -> 4 data
    # epochs (ceil 3.5), which make 2.29 (to 4.29); phase 2: the 1.71 left at 0.21 -> 9
    assert [(p.start_epoch, p.end_epoch) for p in got] == [(0, 2), (2, 6), (6, 15)]
    assert got[1].progress_start == 2.0
    assert got[1].progress_end == pytest.approx(2 + 4 * per_epoch[1])
    assert got[2].progress_start == got[1].progress_end
    assert got[2].progress_end == pytest.approx(got[2].progress_start + 9 * per_epoch[2])
    assert 6 <= got[2].progress_end < 6 + per_epoch[2]  # ends at the first epoch past 6
    # progress grows linearly over a phase's epochs of data
    assert got[1].progress_at(4.0) == pytest.approx(2 + 2 * per_epoch[1])
    assert Stepwise({0: 16}).next_phase(start_epoch=0, total_epochs=2, previous=None).progress_at(
        1.0
    ) is None  # fmt: skip


def test_scale_invariant_stepwise_stretches_nothing_where_the_noise_dominates():
    """A gain of B/B0 (all noise, or |G|^2 not resolved) is a whole epoch of progress per
    epoch of data: the table's epochs, as without counting progress."""
    schedule = Stepwise({0: 16, 2: 64, 4: 256}, scale_invariant=True)
    drowned = PhaseMeasurement(gradient_sq=-0.2, trace_cov=5.0, steps=40, measured_steps=40)
    for measured in (measured_after(40, 1e12), drowned):
        got = progress_phases(schedule, 6, measured)
        assert [(p.start_epoch, p.end_epoch) for p in got] == [(0, 2), (2, 4), (4, 6)]
        assert got[-1].progress_end == pytest.approx(6.0)


def test_scale_invariant_stepwise_keeps_the_last_gain_until_an_estimate_is_trusted():
    """Without a trusted estimate a phase is credited the previous phase's gain (1 after
    the first: the longest stretch, B/B0), as its LR keeps the previous scale."""
    schedule = Stepwise({0: 16, 1: 64, 2: 128}, scale_invariant=True, min_measured_steps=30)
    got = progress_phases(schedule, 3, measured_after(29, 48.0))  # never trusted
    assert [(p.start_epoch, p.end_epoch) for p in got] == [(0, 1), (1, 5), (5, 13)]
    assert [p.lr_scale for p in got] == [1.0, 1.0, 1.0]
    first = got[0]
    trusted = schedule.next_phase(
        start_epoch=1, total_epochs=3, previous=first, measured=measured_after(30, 48.0)
    )
    gain = (1 + 48 / 16) / (1 + 48 / 64)
    kept = schedule.next_phase(
        start_epoch=trusted.end_epoch, total_epochs=3, previous=trusted, measured=None
    )
    per_epoch = (kept.progress_end - kept.progress_start) / (kept.end_epoch - kept.start_epoch)
    assert per_epoch == pytest.approx(gain * 16 / 128)  # the gain kept, at the new batch
    # Adam's rule takes the gain's square root for the LR, the gain itself for progress
    root = Stepwise({0: 16, 1: 64}, lr_scaling="adascale-sqrt", scale_invariant=True)
    second = progress_phases(root, 2, measured_after(40, 48.0))[1]
    assert second.lr_scale == pytest.approx(gain**0.5)
    assert second.progress_end - second.progress_start == pytest.approx(
        gain * 16 / 64 * (second.end_epoch - second.start_epoch)
    )


def test_scale_invariant_stepwise_is_refused_without_a_measured_gain():
    for rule in ("linear", "sqrt", "none"):
        with pytest.raises(dfl.ConfigError, match="scale_invariant=True\\): progress is counted"):
            Stepwise({0: 8, 1: 16}, lr_scaling=rule, scale_invariant=True)
    with pytest.raises(dfl.ConfigError, match="scale_invariant=1\\): must be True or False"):
        Stepwise({0: 8}, scale_invariant=1)
    with pytest.raises(dfl.ConfigError, match="progress_start"):
        dfl.schedule.PhaseSpec(
            index=0, start_epoch=0, end_epoch=1, global_batch=8, progress_start=1.0
        )


def test_fixed_cuts_phases_when_asked():
    assert [(p.start_epoch, p.end_epoch) for p in phases(Fixed(8, epochs_per_phase=2), 5)] == [
        (0, 2),
        (2, 4),
        (4, 5),
    ]


def test_lr_ramps_linearly_to_the_target():
    assert [lr_at(0.1, 0.5, k, 4) for k in range(6)] == pytest.approx(
        [0.2, 0.3, 0.4, 0.5, 0.5, 0.5]
    )
    assert lr_at(0.1, 0.5, 0, 0) == 0.5


@given(
    total=st.integers(0, 5000),
    speeds=st.lists(st.floats(0.0, 1000.0), min_size=1, max_size=8),
)
def test_throughput_split_sums_exactly_and_follows_speed(total, speeds):
    shares = Throughput(smoothing=1.0).split(total, len(speeds), [speeds])
    assert sum(shares) == total and len(shares) == len(speeds)
    filled = smoothed_speeds([speeds], len(speeds), 1.0)
    exact = [s / sum(filled) * total for s in filled]
    assert all(abs(a - b) < 1 + 1e-9 for a, b in zip(shares, exact, strict=True))


def test_throughput_balancer_cases():
    balancer = Throughput(smoothing=1.0)
    assert balancer.split(90, 3) == (30, 30, 30)  # nothing measured: even
    assert balancer.split(90, 2, [[100.0, 50.0]]) == (60, 30)  # 2x slower: half the batch
    # A replica with no measurement (new, or idle) gets the mean of the others: even.
    assert balancer.split(90, 3, [[100.0, 100.0, 0.0]]) == (30, 30, 30)
    assert balancer.split(90, 3, [[100.0, 100.0]]) == (30, 30, 30)
    smooth = Throughput(smoothing=0.5).split(100, 2, [[100.0, 100.0], [100.0, 20.0]])
    assert smooth == (63, 37)  # 100 vs (0.5 * 20 + 0.5 * 100) = 60
    with pytest.raises(dfl.ConfigError, match="smoothing"):
        Throughput(smoothing=0.0)


def test_fixed_and_stepwise_ignore_measurements():
    """The driver passes what it measured to every schedule; only Adaptive and Stepwise's
    AdaScale rules (its default) use it."""
    measured = PhaseMeasurement(noise_scale=1e6, samples_per_second=100.0, steps=3)
    for schedule in (Fixed(8, epochs_per_phase=1), Stepwise({0: 8, 1: 16}, lr_scaling="sqrt")):
        assert not schedule.measures_noise
        first = schedule.next_phase(start_epoch=0, total_epochs=3, previous=None)
        plain = schedule.next_phase(start_epoch=1, total_epochs=3, previous=first)
        told = schedule.next_phase(start_epoch=1, total_epochs=3, previous=first, measured=measured)
        assert told == plain and told.noise_scale is None and told.gain is None
