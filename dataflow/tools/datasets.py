"""Small datasets for the examples and benchmarks, made on the spot (no downloads).

* :func:`cosmology_fields`: 3D log-normal density fields whose power spectrum
  ``P(k) = A (k / k_pivot)^n`` is set by an amplitude ``A`` and a spectral index ``n``,
  the shape of the CosmoFlow task (regress the cosmological parameters of a simulated
  matter density), generated in seconds; :func:`cosmology_arrays` adds a train/test
  split and standardised targets.
* :func:`digits_arrays`: scikit-learn's bundled handwritten digits (real data, 1797
  8x8 images), split into train and test.
* :func:`signals_arrays`: 1D signal classification: noisy waveforms of six kinds
  (sine, square, triangle, sawtooth, rising and falling chirp) with random frequency,
  phase, amplitude, offset and noise, hard enough that a small 1D CNN stays below 100 %.
* :func:`gratings_arrays`: a 2D image regression: noisy oriented gratings (Gabor-like
  patches); the targets are the orientation (as ``cos 2θ, sin 2θ``) and the spatial
  frequency, standardised.

Everything is numpy; write it to zarr with :func:`dataflow.io.to_zarr`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dataflow.core.errors import ConfigError

K_PIVOT = 4.0  # in units of the box's fundamental mode: P(k_pivot) = c A
AMPLITUDE_RANGE = (0.5, 1.5)
INDEX_RANGE = (-3.0, -1.0)
# var(g) = FIELD_SCALE A sum_k (k/k_pivot)^n: about 0.1 to 1 over the ranges at side 16, a
# matter field that is clearly non-Gaussian after the log-normal transform but not extreme.
FIELD_SCALE = 2.5e-4


def gaussian_random_fields(
    amplitude: np.ndarray, index: np.ndarray, side: int, rng: np.random.Generator
) -> np.ndarray:
    """Real zero-mean fields ``g`` on periodic ``side^3`` grids, ``P(k) = c A (k/k_pivot)^n``.

    White noise filtered in Fourier space by ``sqrt(P)`` (``k`` in units of the
    fundamental mode); the ``k = 0`` mode is zero, so each field has zero mean.
    """
    k1 = np.fft.fftfreq(side) * side
    k1r = np.fft.rfftfreq(side) * side
    k = np.sqrt(k1[:, None, None] ** 2 + k1[None, :, None] ** 2 + k1r[None, None, :] ** 2)
    k[0, 0, 0] = 1.0
    out = np.empty((len(amplitude), side, side, side), dtype=np.float32)
    for i, (a, n) in enumerate(zip(amplitude, index, strict=True)):
        power = FIELD_SCALE * a * (k / K_PIVOT) ** n * side**3
        power[0, 0, 0] = 0.0
        noise = np.fft.rfftn(rng.standard_normal((side, side, side)))
        out[i] = np.fft.irfftn(noise * np.sqrt(power), s=(side, side, side), axes=(0, 1, 2))
    return out


def cosmology_fields(
    n: int,
    side: int = 16,
    seed: int = 0,
    *,
    amplitude_range: tuple[float, float] = AMPLITUDE_RANGE,
    index_range: tuple[float, float] = INDEX_RANGE,
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` log-normal density fields and their parameters.

    Returns ``x``, float32 ``[n, 1, side, side, side]``: the density contrast
    ``delta = exp(g - var(g)/2) - 1`` (>= -1, mean about 0, skewed like the matter
    density) of a Gaussian field ``g`` with ``P(k) = A (k/k_pivot)^n``; and
    ``params``, float32 ``[n, 2]``: ``(A, n)`` drawn uniformly from the two ranges.
    ``log1p(delta)`` recovers the Gaussian field up to a shift, a good first layer.
    """
    delta, params, _ = _lognormal_fields(n, side, seed, amplitude_range, index_range)
    return delta, params


def _lognormal_fields(
    n: int,
    side: int,
    seed: int,
    amplitude_range: tuple[float, float],
    index_range: tuple[float, float],
    box: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fields, their parameters and each Gaussian field's variance. ``box``: how
    many times wider the box is than the 16^3 reference at the same resolution: ``k``
    counts a box's fundamental modes, so the pivot sits at ``box × k_pivot`` and the
    power per mode scales as ``box^(-n-3)`` (the power per unit volume stays put)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"cosmology_fields(n={n!r}): the number of fields, an int >= 1")
    if isinstance(side, bool) or not isinstance(side, int) or side < 4:
        raise ConfigError(f"cosmology_fields(side={side!r}): grid cells per side, an int >= 4")
    for name, (lo, hi) in (("amplitude_range", amplitude_range), ("index_range", index_range)):
        if not lo < hi:
            raise ConfigError(f"cosmology_fields({name}=({lo}, {hi})): need low < high")
    if not amplitude_range[0] > 0:
        raise ConfigError(
            f"cosmology_fields(amplitude_range={amplitude_range}): amplitudes must be > 0"
        )
    rng = np.random.default_rng(seed)
    params = np.stack(
        [rng.uniform(*amplitude_range, size=n), rng.uniform(*index_range, size=n)], axis=1
    ).astype(np.float32)
    amplitude = params[:, 0] * box ** (-params[:, 1] - 3) if box != 1.0 else params[:, 0]
    g = gaussian_random_fields(amplitude, params[:, 1], side, rng)
    var = g.reshape(n, -1).var(axis=1)
    delta = (np.exp(g - var[:, None, None, None] / 2) - 1.0).astype(np.float32)[:, None]
    return delta, params, var


def cosmology_arrays(
    n_train: int, n_test: int, side: int = 16, seed: int = 0, *, box: float = 1.0
) -> dict[str, Any]:
    """:func:`cosmology_fields` split into train and test, targets standardised with the
    training set's mean and std (so predicting 0 is the predict-the-mean baseline).
    ``box``: the box ``box`` times as wide as the 16^3 reference at the same resolution
    (``side = 16 × box`` keeps the fields' statistics per unit volume; >= 1).

    Keys: ``x_train``, ``y_train``, ``x_test``, ``y_test`` (arrays), ``params_test``
    (the test set's raw ``(A, n)``), ``target_mean``, ``target_std`` (lists, to undo the
    standardisation: ``params = y * std + mean``), ``field_variance`` (min, median, max
    of ``var(g)`` over the fields).
    """
    _check_count("cosmology_arrays", "n_train", n_train, 2)
    _check_count("cosmology_arrays", "n_test", n_test, 1)
    if not (isinstance(box, int | float) and not isinstance(box, bool) and box > 0):
        raise ConfigError(f"cosmology_arrays(box={box!r}): the box's width over 16 cells, > 0")
    x, params, var = _lognormal_fields(
        n_train + n_test, side, seed, AMPLITUDE_RANGE, INDEX_RANGE, box=float(box)
    )
    return {
        **_standardized_split(x, params, n_train),
        "params_test": params[n_train:],
        "field_variance": [float(var.min()), float(np.median(var)), float(var.max())],
    }


def digits_arrays(seed: int = 0, test_fraction: float = 0.2) -> dict[str, np.ndarray]:
    """scikit-learn's handwritten digits as float32 images in [0, 1], ``[N, 1, 8, 8]``,
    int64 labels 0-9; shuffled once by ``seed`` and split, the last ``test_fraction``
    held out. Needs scikit-learn (``pip install scikit-learn``); the data ships with it."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"digits_arrays(test_fraction={test_fraction}): must be in (0, 1)")
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "digits_arrays needs scikit-learn: pip install scikit-learn "
            "(or pip install -e '.[examples]')"
        ) from exc
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    cut = int((1.0 - test_fraction) * len(y))
    return {"x_train": x[:cut], "y_train": y[:cut], "x_test": x[cut:], "y_test": y[cut:]}


SIGNAL_CLASSES = ("sine", "square", "sawtooth", "burst", "chirp-up", "chirp-down")


def _standardized_split(x: np.ndarray, params: np.ndarray, n_train: int) -> dict[str, Any]:
    """The first ``n_train`` samples for training, the rest held out; targets standardised
    with the training set's mean and std (``params = y * std + mean``)."""
    mean, std = params[:n_train].mean(axis=0), params[:n_train].std(axis=0)
    y = ((params - mean) / std).astype(np.float32)
    return {
        "x_train": x[:n_train],
        "y_train": y[:n_train],
        "x_test": x[n_train:],
        "y_test": y[n_train:],
        "target_mean": mean.tolist(),
        "target_std": std.tolist(),
    }


def _check_count(owner: str, field: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{owner}({field}={value!r}): need an int >= {low}")
    return value


def signal_waveforms(
    n: int, length: int = 128, seed: int = 0, *, noise: float = 0.3
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy 1D waveforms of the six :data:`SIGNAL_CLASSES`, balanced, in random order.

    Each signal is ``a w(phase(t)) + c + drift + noise`` on ``length`` samples with ``t``
    in ``[0, 1)``: amplitude ``a`` in [0.5, 1.5], offset ``c`` in [-0.5, 0.5], a random
    start phase, a random-walk drift and white Gaussian noise of std
    ``noise × U(0.5, 1.5)``. Sine, square, sawtooth and burst (a sine under a Gaussian
    window of width 0.1 to 0.2 at a random centre) have 2 to 8 cycles; the chirps sweep
    their local frequency from 1-3 to 8-10 cycles per unit time, up or down. At the
    default noise a small 1D CNN reaches about 90 % (noisy sines and bursts, squares and
    sawtooths blur), not 100 %.

    Returns ``x``, float32 ``[n, 1, length]``, and ``y``, int64 class indices ``[n]``.
    """
    _check_count("signal_waveforms", "n", n, 1)
    _check_count("signal_waveforms", "length", length, 16)
    if isinstance(noise, bool) or not isinstance(noise, int | float) or not noise >= 0:
        raise ConfigError(f"signal_waveforms(noise={noise!r}): a number >= 0")
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % len(SIGNAL_CLASSES)).astype(np.int64)
    t = np.arange(length) / length
    start = rng.uniform(0.0, 1.0, size=(n, 1))
    freq = rng.uniform(2.0, 8.0, size=(n, 1))
    cycles = start + freq * t  # the phase in cycles
    low, high = rng.uniform(1.0, 3.0, size=(n, 1)), rng.uniform(8.0, 10.0, size=(n, 1))
    up = start + low * t + (high - low) * t**2 / 2  # local frequency low -> high
    down = start + high * t - (high - low) * t**2 / 2
    frac = cycles % 1.0
    centre = rng.uniform(0.3, 0.7, size=(n, 1))
    width = rng.uniform(0.1, 0.2, size=(n, 1))
    shapes = {
        0: np.sin(2 * np.pi * cycles),
        1: np.sign(np.sin(2 * np.pi * cycles)),
        2: 2 * frac - 1,
        3: np.sin(2 * np.pi * cycles) * np.exp(-(((t - centre) / width) ** 2)),
        4: np.sin(2 * np.pi * up),
        5: np.sin(2 * np.pi * down),
    }
    wave = np.zeros((n, length))
    for label, shape in shapes.items():
        wave[y == label] = shape[y == label]
    amplitude = rng.uniform(0.5, 1.5, size=(n, 1))
    offset = rng.uniform(-0.5, 0.5, size=(n, 1))
    sigma = noise * rng.uniform(0.5, 1.5, size=(n, 1))
    drift = np.cumsum(rng.standard_normal((n, length)), axis=1) * (0.3 / np.sqrt(length))
    x = amplitude * wave + offset + drift + sigma * rng.standard_normal((n, length))
    return x.astype(np.float32)[:, None], y


def signals_arrays(
    n_train: int = 2400, n_test: int = 1200, length: int = 128, seed: int = 0
) -> dict[str, np.ndarray]:
    """:func:`signal_waveforms` split into train and test (one draw, the first
    ``n_train`` for training). Keys ``x_train``, ``y_train``, ``x_test``, ``y_test``."""
    _check_count("signals_arrays", "n_train", n_train, 1)
    _check_count("signals_arrays", "n_test", n_test, 1)
    x, y = signal_waveforms(n_train + n_test, length, seed)
    return {
        "x_train": x[:n_train],
        "y_train": y[:n_train],
        "x_test": x[n_train:],
        "y_test": y[n_train:],
    }


FREQUENCY_RANGE = (1.5, 4.0)  # grating cycles across the image


def grating_images(
    n: int, side: int = 16, seed: int = 0, *, noise: float = 0.6
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy oriented gratings and their parameters (a 2D regression).

    Each image is ``c cos(2π f (u cos θ + v sin θ) + φ) × envelope + noise`` on a
    ``side × side`` grid with ``u, v`` in ``[-0.5, 0.5)``: orientation ``θ`` uniform in
    ``[0, π)``, spatial frequency ``f`` uniform in :data:`FREQUENCY_RANGE` cycles per
    image, a random phase ``φ``, contrast ``c`` in [0.5, 1.5], a Gaussian envelope of
    random width (0.2 to 0.5) at a random centre, and white noise of std ``noise``.

    Returns ``x``, float32 ``[n, 1, side, side]``, and ``params``, float32 ``[n, 3]``:
    ``(cos 2θ, sin 2θ, f)`` (the orientation doubled, so θ and θ + π, the same
    grating, have the same target and the target is continuous).
    """
    _check_count("grating_images", "n", n, 1)
    _check_count("grating_images", "side", side, 4)
    if isinstance(noise, bool) or not isinstance(noise, int | float) or not noise >= 0:
        raise ConfigError(f"grating_images(noise={noise!r}): a number >= 0")
    rng = np.random.default_rng(seed)
    theta = rng.uniform(0.0, np.pi, size=n)
    freq = rng.uniform(*FREQUENCY_RANGE, size=n)
    phase = rng.uniform(0.0, 2 * np.pi, size=n)
    contrast = rng.uniform(0.5, 1.5, size=n)
    width = rng.uniform(0.2, 0.5, size=n)
    centre = rng.uniform(-0.2, 0.2, size=(n, 2))
    u = (np.arange(side) / side - 0.5)[None, :, None]
    v = (np.arange(side) / side - 0.5)[None, None, :]
    c, s = np.cos(theta)[:, None, None], np.sin(theta)[:, None, None]
    wave = np.cos(2 * np.pi * freq[:, None, None] * (u * c + v * s) + phase[:, None, None])
    r2 = (u - centre[:, 0, None, None]) ** 2 + (v - centre[:, 1, None, None]) ** 2
    envelope = np.exp(-r2 / (2 * width[:, None, None] ** 2))
    x = contrast[:, None, None] * wave * envelope + noise * rng.standard_normal((n, side, side))
    params = np.stack([np.cos(2 * theta), np.sin(2 * theta), freq], axis=1)
    return x.astype(np.float32)[:, None], params.astype(np.float32)


def gratings_arrays(
    n_train: int = 2048, n_test: int = 1024, side: int = 16, seed: int = 0
) -> dict[str, Any]:
    """:func:`grating_images` split into train and test, targets standardised with the
    training set's mean and std (predicting 0 is the predict-the-mean baseline).

    Keys: ``x_train``, ``y_train``, ``x_test``, ``y_test`` (arrays), ``target_mean``,
    ``target_std`` (lists: ``params = y * std + mean``).
    """
    _check_count("gratings_arrays", "n_train", n_train, 2)
    _check_count("gratings_arrays", "n_test", n_test, 1)
    x, params = grating_images(n_train + n_test, side, seed)
    return _standardized_split(x, params, n_train)
