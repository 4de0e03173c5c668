"""Small datasets for the examples and benchmarks, made on the spot (no downloads).

* :func:`cosmology_fields`: 3D log-normal density fields whose power spectrum
  ``P(k) = A (k / k_pivot)^n`` is set by an amplitude ``A`` and a spectral index ``n``,
  the shape of the CosmoFlow task (regress the cosmological parameters of a simulated
  matter density), generated in seconds; :func:`cosmology_arrays` adds a train/test
  split and standardised targets.
* :func:`digits_arrays`: scikit-learn's bundled handwritten digits (real data, 1797
  8x8 images), split into train and test.

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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fields, their parameters and each Gaussian field's variance."""
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
    g = gaussian_random_fields(params[:, 0], params[:, 1], side, rng)
    var = g.reshape(n, -1).var(axis=1)
    delta = (np.exp(g - var[:, None, None, None] / 2) - 1.0).astype(np.float32)[:, None]
    return delta, params, var


def cosmology_arrays(n_train: int, n_test: int, side: int = 16, seed: int = 0) -> dict[str, Any]:
    """:func:`cosmology_fields` split into train and test, targets standardised with the
    training set's mean and std (so predicting 0 is the predict-the-mean baseline).

    Keys: ``x_train``, ``y_train``, ``x_test``, ``y_test`` (arrays), ``params_test``
    (the test set's raw ``(A, n)``), ``target_mean``, ``target_std`` (lists, to undo the
    standardisation: ``params = y * std + mean``), ``field_variance`` (min, median, max
    of ``var(g)`` over the fields).
    """
    if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 2:
        raise ConfigError(f"cosmology_arrays(n_train={n_train!r}): need an int >= 2")
    if isinstance(n_test, bool) or not isinstance(n_test, int) or n_test < 1:
        raise ConfigError(f"cosmology_arrays(n_test={n_test!r}): need an int >= 1")
    x, params, var = _lognormal_fields(n_train + n_test, side, seed, AMPLITUDE_RANGE, INDEX_RANGE)
    mean, std = params[:n_train].mean(axis=0), params[:n_train].std(axis=0)
    y = ((params - mean) / std).astype(np.float32)
    return {
        "x_train": x[:n_train],
        "y_train": y[:n_train],
        "x_test": x[n_train:],
        "y_test": y[n_train:],
        "params_test": params[n_train:],
        "target_mean": mean.tolist(),
        "target_std": std.tolist(),
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
