"""The gradient-noise-scale estimator: pure, no cluster, no torch.

Synthetic per-sample gradients ``g_i = G + ε_i`` with a known mean ``G`` and a known
diagonal covariance ``Σ`` have a known noise scale ``B_simple = tr(Σ)/|G|²``; the
tracker fed the norms a data-parallel step would measure must recover it.
"""

import json
import math
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dataflow as dfl
from dataflow.schedule.noise_scale import (
    NoiseScaleTracker,
    NormPair,
    adascale_gain,
    unbiased_estimates,
)

DIM = 1000
TRUE_NOISE_SCALE = 200.0


def gradient_model(seed: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray]:
    """A known mean gradient and per-sample variances (anisotropic, like a real net)."""
    rng = np.random.default_rng(seed)
    variances = rng.uniform(0.5, 1.5, DIM) / np.sqrt(np.arange(1, DIM + 1))
    mean = rng.normal(size=DIM)
    mean *= math.sqrt(variances.sum() / TRUE_NOISE_SCALE / (mean @ mean))
    assert variances.sum() / (mean @ mean) == pytest.approx(TRUE_NOISE_SCALE)
    return rng, mean, variances


def per_sample_gradients(rng, mean, variances, count: int) -> np.ndarray:
    return mean + rng.standard_normal((count, DIM)) * np.sqrt(variances)


def sq(vector: np.ndarray) -> float:
    return float(vector @ vector)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_known_noise_scale_from_uneven_replicas(seed):
    """Replicas with uneven local batches inside one global batch: one pair per replica
    (its local gradient against the allreduced global one)."""
    rng, mean, variances = gradient_model(seed)
    local_batches = [8, 24, 40, 56]  # a balancer's uneven split of B = 128
    tracker = NoiseScaleTracker()
    for _ in range(300):
        samples = per_sample_gradients(rng, mean, variances, sum(local_batches))
        parts = np.split(samples, np.cumsum(local_batches)[:-1])
        global_sq = sq(samples.mean(axis=0))
        tracker.update([NormPair(len(p), sq(p.mean(axis=0)), 128, global_sq) for p in parts])
    assert tracker.steps == 300
    assert tracker.noise_scale == pytest.approx(TRUE_NOISE_SCALE, rel=0.10)
    assert tracker.gradient_sq == pytest.approx(sq(mean), rel=0.10)
    assert tracker.trace_cov == pytest.approx(variances.sum(), rel=0.10)


def test_recovers_known_noise_scale_from_micro_batches():
    """One replica: its micro-batches inside its local batch give the pairs."""
    rng, mean, variances = gradient_model(3)
    micro, count = 32, 4
    tracker = NoiseScaleTracker()
    for _ in range(300):
        samples = per_sample_gradients(rng, mean, variances, micro * count)
        local_sq = sq(samples.mean(axis=0))
        micros = samples.reshape(count, micro, DIM).mean(axis=1)
        tracker.update([NormPair(micro, sq(g), micro * count, local_sq) for g in micros])
    assert tracker.noise_scale == pytest.approx(TRUE_NOISE_SCALE, rel=0.10)


def test_estimates_are_exact_on_expected_norms():
    """Fed the expected norms ``|G|² + tr(Σ)/b``, the estimators return the truth: the
    formulas (not just the simulation) are right, for any pair of batches."""
    gradient_sq, trace_cov = 3.0, 600.0
    pairs = [
        NormPair(b, gradient_sq + trace_cov / b, big, gradient_sq + trace_cov / big)
        for b, big in [(8, 128), (56, 128), (1.5, 2.0), (32, 96)]
    ]
    assert unbiased_estimates(pairs) == pytest.approx((gradient_sq, trace_cov))
    assert unbiased_estimates(pairs[:1]) == pytest.approx((gradient_sq, trace_cov))


def test_negative_gradient_estimate_gives_no_noise_scale():
    """When noise dominates, |G_B|² < (b/B)|G_b|² and the |G|² estimate is negative:
    kept as is (clipping would bias the average up), noise scale None until the
    smoothed |G|² is positive again."""
    tracker = NoiseScaleTracker(smoothing=0.5)
    noisy = NormPair(small_batch=16, small_sq=10.0, big_batch=32, big_sq=4.0)
    assert unbiased_estimates([noisy])[0] == pytest.approx(-2.0)  # (32·4 − 16·10)/16
    tracker.update([noisy])
    assert tracker.gradient_sq == pytest.approx(-2.0)
    assert tracker.trace_cov == pytest.approx(192.0)  # (10 − 4)/(1/16 − 1/32)
    assert tracker.noise_scale is None
    clean = NormPair(small_batch=16, small_sq=10.0, big_batch=32, big_sq=8.0)  # |G|² = 6
    tracker.update([clean])
    # Bias-corrected EMA of -2 and 6 with weight 0.5: (0.25·-2 + 0.5·6)/0.75.
    assert tracker.gradient_sq == pytest.approx((0.25 * -2 + 0.5 * 6) / 0.75)
    assert tracker.noise_scale == pytest.approx(tracker.trace_cov / tracker.gradient_sq)


def test_negative_trace_estimate_counts_as_no_noise():
    tracker = NoiseScaleTracker()
    tracker.update([NormPair(16, 4.0, 32, 5.0)])  # the bigger batch has the larger norm
    assert tracker.trace_cov < 0 < tracker.gradient_sq
    assert tracker.noise_scale == 0.0


def test_tracker_first_step_empty_steps_and_reset():
    tracker = NoiseScaleTracker(smoothing=0.1)
    assert (tracker.noise_scale, tracker.gradient_sq, tracker.trace_cov) == (None, None, None)
    tracker.update([])  # one replica, one micro-batch: nothing measured
    assert tracker.steps == 0 and tracker.noise_scale is None
    pair = NormPair(8, 3.0, 32, 1.5)
    tracker.update([pair])
    # Bias correction: the first step is its own estimate, not pulled toward zero.
    assert (tracker.gradient_sq, tracker.trace_cov) == pytest.approx(unbiased_estimates([pair]))
    tracker.reset()
    assert tracker.steps == 0 and tracker.noise_scale is None


def test_tracker_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(5)
    steps = [
        [NormPair(b, float(rng.uniform(2, 3)), 64, float(rng.uniform(1, 2))) for b in (16, 48)]
        for _ in range(20)
    ]
    whole = NoiseScaleTracker(smoothing=0.2)
    for step in steps:
        whole.update(step)
    first = NoiseScaleTracker(smoothing=0.2)
    for step in steps[:7]:
        first.update(step)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints may go through JSON
    resumed = NoiseScaleTracker()
    resumed.load_state_dict(state)
    assert resumed.smoothing == 0.2 and resumed.steps == 7
    resumed = pickle.loads(pickle.dumps(resumed))
    for step in steps[7:]:
        resumed.update(step)
    assert resumed.state_dict() == pytest.approx(whole.state_dict())
    assert resumed.noise_scale == pytest.approx(whole.noise_scale)
    with pytest.raises(dfl.ConfigError, match="expected keys"):
        resumed.load_state_dict({"steps": 3})


def test_inputs_are_validated():
    with pytest.raises(dfl.DataError, match="0 < small_batch < big_batch"):
        NormPair(32, 1.0, 32, 1.0)
    with pytest.raises(dfl.DataError, match="small_sq is nan"):
        NormPair(8, float("nan"), 32, 1.0)
    with pytest.raises(dfl.DataError, match="squared norms must be >= 0"):
        NormPair(8, -1.0, 32, 1.0)
    with pytest.raises(dfl.DataError, match="pairs is empty"):
        unbiased_estimates([])
    for bad in (0, 1.5, -0.1):
        with pytest.raises(dfl.ConfigError, match=r"smoothing=.*must be in \(0, 1\]"):
            NoiseScaleTracker(smoothing=bad)


def test_adascale_gain_limits():
    assert adascale_gain(0.0, 32, 256) == 1.0  # no noise: a bigger batch does not help
    assert adascale_gain(math.inf, 32, 256) == 8.0  # pure noise: linear scaling
    assert adascale_gain(1e12, 32, 256) == pytest.approx(8.0)
    assert adascale_gain(500.0, 32, 32) == 1.0
    # B_noise = B0: (1 + 1)/(1 + 32/256)
    assert adascale_gain(32.0, 32, 256) == pytest.approx(2 / 1.125)
    with pytest.raises(dfl.ConfigError, match="noise_scale must be >= 0"):
        adascale_gain(-1.0, 32, 64)
    with pytest.raises(dfl.ConfigError, match="base_batch must be > 0"):
        adascale_gain(1.0, 0, 64)


@given(
    noise=st.floats(0.0, 1e9),
    more_noise=st.floats(0.0, 1e9),
    base=st.integers(1, 4096),
    scale=st.floats(1.0, 64.0),
    more_scale=st.floats(1.0, 64.0),
)
def test_adascale_gain_is_bounded_and_monotone(noise, more_noise, base, scale, more_scale):
    noise, more_noise = sorted((noise, more_noise))
    scale, more_scale = sorted((scale, more_scale))
    batch, bigger = base * scale, base * more_scale
    gain = adascale_gain(noise, base, batch)
    assert 1.0 - 1e-12 <= gain <= scale * (1 + 1e-12)
    assert adascale_gain(more_noise, base, batch) >= gain * (1 - 1e-12)
    assert adascale_gain(noise, base, bigger) >= gain * (1 - 1e-12)
