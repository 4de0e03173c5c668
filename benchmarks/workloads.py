"""What a benchmark trains: the models (the examples' own and small ones of its own),
their synthetic data, the optimizers, and :class:`Workload` (what both sides of a
comparison train).

Everything here is importable from a spawned process (hand loop, DDP ranks) and is
pickled by value to Dask workers (see :func:`ship_to_workers`), so the benchmarks
run from a plain checkout without installing this folder.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))

# The examples' models, not copies: what a user runs is what is measured.
import cosmoflow  # noqa: E402
import digits  # noqa: E402
from cosmoflow import CosmoNet as CosmoNet  # noqa: E402
from digits import DigitsNet as DigitsNet  # noqa: E402


@dataclass(frozen=True)
class CNNConfig:
    """A plain conv net: ``[conv3x3 -> ReLU (-> conv3x3 -> ReLU)] -> maxpool`` per stage."""

    in_channels: int = 3
    image: int = 32
    channels: tuple[int, ...] = (16, 32)
    convs_per_stage: int = 1
    hidden: int = 64
    classes: int = 10


class CNN(torch.nn.Module):
    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        c, size = config.in_channels, config.image
        for width in config.channels:
            for _ in range(config.convs_per_stage):
                layers += [torch.nn.Conv2d(c, width, 3, padding=1), torch.nn.ReLU()]
                c = width
            layers.append(torch.nn.MaxPool2d(2))
            size //= 2
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(c * size * size, config.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(config.hidden, config.classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@dataclass(frozen=True)
class ModelFactory:
    """A picklable ``() -> CNN`` (what ``Pipeline(model=...)`` calls once per replica)."""

    config: CNNConfig

    def __call__(self) -> CNN:
        return CNN(self.config)


def parameter_count(config: CNNConfig) -> int:
    return sum(p.numel() for p in CNN(config).parameters())


def make_data(n: int, config: CNNConfig, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic images and labels, deterministic in ``seed`` (regenerated in each process)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, config.in_channels, config.image, config.image), dtype=np.float32)
    y = rng.integers(0, config.classes, size=n).astype(np.int64)
    return x, y


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 0.01
    momentum: float = 0.9


@dataclass(frozen=True)
class OptimizerFactory:
    """Picklable ``params -> SGD(momentum)``, the same for dataflow and the baselines."""

    config: OptimConfig

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.config.lr, momentum=self.config.momentum)


def ship_to_workers() -> None:
    """Pickle this module and the examples' (whose models the benchmarks train) by
    value, so Dask workers need not import them."""
    import cloudpickle

    for module in (sys.modules[__name__], cosmoflow, digits):
        cloudpickle.register_pickle_by_value(module)


class SignalNet(torch.nn.Module):
    """Three 1D conv stages, global average pooling, a linear head (6 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv1d(1, 16, 7, padding=3),
            torch.nn.ReLU(),
            torch.nn.MaxPool1d(2),
            torch.nn.Conv1d(16, 32, 5, padding=2),
            torch.nn.ReLU(),
            torch.nn.MaxPool1d(2),
            torch.nn.Conv1d(32, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool1d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(32, 6),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class TargetMSE:
    """The held-out MSE of one regression target (column ``j``), an eval metric (in
    fp32 whatever the output's precision)."""

    j: int

    def __call__(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((output[:, self.j].float() - y[:, self.j]) ** 2).mean()


@dataclass(frozen=True)
class Optimizer:
    """Picklable ``params -> SGD(lr, momentum 0.9)`` or ``Adam(lr)``."""

    kind: str
    lr: float

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.Adam(params, lr=self.lr)


@dataclass
class Workload:
    """What both sides train: model, data, global batch, epochs, seed, optimizer."""

    model: CNNConfig
    samples: int
    batch: int
    epochs: int
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.samples / self.batch)

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs


def fit_batches(source: Any, batch: int, epochs: int = 1) -> list[list[np.ndarray]]:
    """Per epoch, the global batches a ``Fixed(batch)`` fit of ``source`` on one replica
    reads (the engine's own shuffle): what a loader benchmark reads as the fit would."""
    import dataflow as dfl

    pipe = dfl.Pipeline(
        model=lambda: torch.nn.Linear(1, 1),
        loss=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        source=source,
        schedule=dfl.schedule.Fixed(batch),
    )
    plan = [np.concatenate(parts) for parts in pipe.sample_plan(epochs=epochs, replicas=1)]
    per_epoch = len(plan) // epochs
    return [plan[e * per_epoch : (e + 1) * per_epoch] for e in range(epochs)]
