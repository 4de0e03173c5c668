"""Simulated slow nodes that move (``dataflow.runtime.throttle``): schedules of a replica's
slow-down factor over wall time, checked with made-up times (pure), and once in a real
fit, where only the replicas given a factor above 1 sleep."""

from __future__ import annotations

import pickle

import pytest
from conftest import make_data, tiny_pipeline

import dataflow as dfl
from dataflow.core.errors import ConfigError
from dataflow.runtime.throttle import NoisyNeighbour, SlowdownSchedule, as_slowdown


def test_a_schedule_holds_each_factor_from_its_second_and_repeats():
    schedule = SlowdownSchedule(((0, 1.0), (2, 3.0), (5, 1.5)))
    assert [schedule.factor_at(t) for t in (0, 1.9, 2, 4.9, 5, 100)] == [1, 1, 3, 3, 1.5, 1.5]
    alternating = SlowdownSchedule.alternating(1.0, 3.0, every_s=3.0)
    assert [alternating.factor_at(t) for t in (0, 2.9, 3, 5.9, 6, 9.5)] == [1, 1, 3, 3, 1, 3]


def test_a_noisy_neighbour_is_the_same_for_a_seed_and_stays_in_its_bounds():
    times = [i * 0.25 for i in range(400)]  # 100 s
    a = [NoisyNeighbour(low=2.0, high=3.0, seed=7).factor_at(t) for t in times]
    b = NoisyNeighbour(low=2.0, high=3.0, seed=7)
    assert [b.factor_at(t) for t in reversed(times)][::-1] == a  # any order of asking
    assert all(f == 1.0 or 2.0 <= f <= 3.0 for f in a)
    assert 0.2 < sum(f > 1 for f in a) / len(a) < 0.8  # on about half the time (3 s / 3 s)
    other = [NoisyNeighbour(low=2.0, high=3.0, seed=8).factor_at(t) for t in times]
    assert other != a
    copy = pickle.loads(pickle.dumps(b))  # sent to a worker: the seed, not the draws
    assert [copy.factor_at(t) for t in times] == a


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (0.5, "must be >= 1"),
        ("2x", "neither a factor"),
    ],
)
def test_a_bad_slowdown_is_refused_naming_it(value, named):
    with pytest.raises(ConfigError, match=named):
        as_slowdown(value)


def test_bad_schedules_are_refused():
    with pytest.raises(ConfigError, match="increasing seconds"):
        SlowdownSchedule(((3, 1.0), (0, 2.0)))
    with pytest.raises(ConfigError, match="factors must be >= 1"):
        SlowdownSchedule(((0, 0.5),))
    with pytest.raises(ConfigError, match="two factors or more"):
        SlowdownSchedule.alternating(2.0, every_s=1.0)
    with pytest.raises(ConfigError, match="1 <= low <= high"):
        NoisyNeighbour(low=3.0, high=2.0)
    x, y = make_data(16)
    with pytest.raises(ConfigError, match="a moving one"):
        tiny_pipeline(x, y, throttle={1: "slow"})


@pytest.mark.slow
def test_only_a_replica_whose_schedule_is_above_one_sleeps(client):
    """Replica 1 under a schedule that is 2x from the start, replica 0 under one that
    stays 1x: only replica 1's steps carry throttle seconds."""
    x, y = make_data(64)
    throttle = {0: SlowdownSchedule(((0, 1.0),)), 1: dfl.SlowdownSchedule(((0, 2.0),))}
    result = tiny_pipeline(x, y, replicas=2, throttle=throttle).fit(1, client=client)
    [phase] = result.history.phases
    throttled = [seconds.get("throttle", 0.0) for seconds in phase.stage_seconds]
    assert throttled[0] == 0.0 and throttled[1] > 0.0
