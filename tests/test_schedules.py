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
    assert [p.lr for p in phases(Stepwise(table, lr=0.1), 3)] == [0.1, 0.4]
    assert Stepwise(table).max_batch() == 256


def test_stepwise_validates_its_table():
    with pytest.raises(dfl.ConfigError, match="needs the batch for epoch 0"):
        Stepwise({3: 64})
    with pytest.raises(dfl.ConfigError, match="key '3' is not an epoch"):
        Stepwise({0: 8, "3": 64})
    with pytest.raises(dfl.BatchSizeError, match="the batch at epoch 2 must be a positive int"):
        Stepwise({0: 8, 2: 0})
    with pytest.raises(dfl.ConfigError, match=r"lr_scaling='cubic'.*\['linear', 'none', 'sqrt'\]"):
        Stepwise({0: 8}, lr_scaling="cubic")
    with pytest.raises(dfl.BatchSizeError, match="epochs_per_phase must be a positive int"):
        Fixed(8, epochs_per_phase=0)


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
    """The driver passes what it measured to every schedule; only Adaptive uses it."""
    measured = PhaseMeasurement(noise_scale=1e6, samples_per_second=100.0, steps=3)
    for schedule in (Fixed(8, epochs_per_phase=1), Stepwise({0: 8, 1: 16})):
        assert not schedule.measures_noise
        first = schedule.next_phase(start_epoch=0, total_epochs=3, previous=None)
        plain = schedule.next_phase(start_epoch=1, total_epochs=3, previous=first)
        told = schedule.next_phase(start_epoch=1, total_epochs=3, previous=first, measured=measured)
        assert told == plain and told.noise_scale is None and told.gain is None
