"""The demo: classify 2D Gaussian random fields by the slope of their power spectrum.

Scientific fields (density, temperature, turbulence) are often characterised by
their power spectrum P(k) ~ k^-alpha. The demo makes fields with three slopes and
trains a small CNN to tell them apart: a task that needs real spatial features,
generated in a second, and learnable in a minute on two CPU cores.
"""

from __future__ import annotations

import numpy as np
import torch

SLOPES = (1.5, 2.5, 3.5)  # one class per spectral slope alpha


def random_fields(n: int, size: int = 32, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` fields of ``size`` x ``size`` (float32, one channel) and their class labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(SLOPES), size=n)
    k = np.sqrt(np.fft.fftfreq(size)[:, None] ** 2 + np.fft.rfftfreq(size)[None, :] ** 2)
    k[0, 0] = np.inf  # no mean component
    noise = np.fft.rfft2(rng.normal(size=(n, size, size)))
    alphas = np.asarray(SLOPES)[labels][:, None, None]
    fields = np.fft.irfft2(noise * k[None] ** (-alphas / 2), s=(size, size))
    fields /= fields.std(axis=(1, 2), keepdims=True)  # amplitude carries no information
    return fields[:, None].astype(np.float32), labels.astype(np.int64)


class FieldNet(torch.nn.Module):
    """Three conv blocks and a linear head: about 15k parameters."""

    def __init__(self, classes: int = len(SLOPES), width: int = 16) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(width, 2 * width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def growing_batches(batch: int, epochs: int, samples: int, *, grow: bool = True) -> dict[int, int]:
    """The demo's schedule ``{epoch: global batch}``: ``batch`` doubled at a third and again
    at two thirds of the epochs (the adaptive-batch strategy: small batches early, when
    the gradient is large, larger ones later), each at most a quarter of the samples."""
    if not grow:
        return {0: batch}
    cap = max(batch, samples // 4)
    table: dict[int, int] = {}
    for k, start in enumerate(sorted({0, epochs // 3, 2 * epochs // 3})):
        size = min(batch * 2**k, cap)
        if not table or size > max(table.values()):
            table[start] = size
    return table
