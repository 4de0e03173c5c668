"""The synthetic dataset generators: shapes, dtypes, determinism by seed. Pure numpy."""

import numpy as np
import pytest

from dataflow.core.errors import ConfigError
from dataflow.tools.datasets import (
    SIGNAL_CLASSES,
    cosmology_arrays,
    grating_images,
    gratings_arrays,
    signal_waveforms,
    signals_arrays,
)


def test_signal_waveforms_shapes_classes_and_seed():
    x, y = signal_waveforms(60, length=64, seed=3)
    assert x.shape == (60, 1, 64) and x.dtype == np.float32
    assert y.shape == (60,) and y.dtype == np.int64
    # balanced: every class equally often
    assert np.bincount(y, minlength=len(SIGNAL_CLASSES)).tolist() == [10] * 6
    again = signal_waveforms(60, length=64, seed=3)
    np.testing.assert_array_equal(x, again[0])
    np.testing.assert_array_equal(y, again[1])
    other = signal_waveforms(60, length=64, seed=4)
    assert not np.array_equal(x, other[0])
    assert np.isfinite(x).all()


def test_signal_waveforms_without_noise_keep_the_class_shape():
    x, y = signal_waveforms(12, length=128, seed=0, noise=0.0)
    square = x[y == 1, 0]
    # a square wave plus offset and a small drift: two clusters of values, 2a apart
    spread = np.percentile(square, 90, axis=1) - np.percentile(square, 10, axis=1)
    assert (spread > 0.8).all()


def test_signals_arrays_split():
    a = signals_arrays(30, 12, length=32, seed=1)
    assert a["x_train"].shape == (30, 1, 32) and a["x_test"].shape == (12, 1, 32)
    assert a["y_train"].shape == (30,) and a["y_test"].shape == (12,)
    x, y = signal_waveforms(42, 32, 1)
    np.testing.assert_array_equal(a["x_test"], x[30:])
    np.testing.assert_array_equal(a["y_train"], y[:30])


def test_grating_images_shapes_targets_and_seed():
    x, params = grating_images(20, side=12, seed=5)
    assert x.shape == (20, 1, 12, 12) and x.dtype == np.float32
    assert params.shape == (20, 3) and params.dtype == np.float32
    # (cos 2θ, sin 2θ) on the unit circle; the frequency within its range
    np.testing.assert_allclose(params[:, 0] ** 2 + params[:, 1] ** 2, 1.0, rtol=1e-5)
    assert ((params[:, 2] >= 1.5) & (params[:, 2] <= 4.0)).all()
    np.testing.assert_array_equal(x, grating_images(20, side=12, seed=5)[0])
    assert not np.array_equal(x, grating_images(20, side=12, seed=6)[0])


def test_gratings_arrays_standardises_with_the_training_set():
    a = gratings_arrays(40, 10, side=8, seed=2)
    assert a["x_train"].shape == (40, 1, 8, 8) and a["y_test"].shape == (10, 3)
    np.testing.assert_allclose(a["y_train"].mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(a["y_train"].std(axis=0), 1.0, rtol=1e-4)
    _, params = grating_images(50, 8, 2)
    undone = a["y_test"] * np.array(a["target_std"]) + np.array(a["target_mean"])
    np.testing.assert_allclose(undone, params[40:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: signal_waveforms(0),
        lambda: signal_waveforms(4, length=8),
        lambda: signal_waveforms(4, noise=-1.0),
        lambda: signals_arrays(0, 5),
        lambda: grating_images(4, side=2),
        lambda: grating_images(4, noise=float("nan")),
        lambda: gratings_arrays(1, 5),
    ],
)
def test_bad_arguments_are_refused(call):
    with pytest.raises(ConfigError):
        call()


def test_a_wider_box_keeps_the_fields_statistics_per_unit_volume():
    """``box=2`` at side 32: twice the width at the 16^3 fields' resolution. The power
    per unit volume is held, so the Gaussian fields' variance stays in the reference
    range (a box twice as wide only adds the longer waves: a little more variance)."""
    small = cosmology_arrays(16, 4, side=16, seed=1)["field_variance"]
    wide = cosmology_arrays(16, 4, side=32, seed=1, box=2.0)["field_variance"]
    unscaled = cosmology_arrays(16, 4, side=32, seed=1)["field_variance"]
    assert small[1] <= wide[1] < 2 * small[1]
    assert unscaled[1] > 1.5 * wide[1]  # the reference A per mode at 8x the modes: too much
    with pytest.raises(ConfigError, match="box=0"):
        cosmology_arrays(4, 2, box=0)
