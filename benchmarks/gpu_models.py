"""The networks bench_gpu.py trains: its small CNN, a ResNet-50 and a CosmoFlow-style
3-D CNN, written here so that a GPU node without torchvision runs them.

The engine and the hand loop build the same network from the same factory: each
class is called with keyword sizes only (``functools.partial`` for the tiny CPU run).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class GpuNet(nn.Module):
    """conv-BN-ReLU stages, strided, global pooling: enough work per step for a GPU."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for w in (width, 2 * width, 4 * width, 8 * width):
            layers += [
                nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(w),
                nn.ReLU(),
                nn.Conv2d(w, w, 3, padding=1, bias=False),
                nn.BatchNorm2d(w),
                nn.ReLU(),
            ]
            c = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in torchvision's v1.5), 1x1 expand by 4, residual."""

    def __init__(self, c_in: int, planes: int, stride: int) -> None:
        super().__init__()
        c_out = 4 * planes
        self.body = nn.Sequential(
            nn.Conv2d(c_in, planes, 1, bias=False),
            nn.BatchNorm2d(planes),
            nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(planes),
            nn.ReLU(inplace=True),
            nn.Conv2d(planes, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50 (He et al.): a 7x7 stem, bottleneck stages of 3-4-6-3 blocks, output
    widths 256-2048 (``width`` 64; the CPU smoke run narrows it), 25.6 M parameters at
    1000 classes."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        ]
        c = width
        for i, blocks in enumerate((3, 4, 6, 3)):
            planes = width * 2**i
            for b in range(blocks):
                layers.append(Bottleneck(c, planes, stride=2 if b == 0 and i > 0 else 1))
                c = 4 * planes
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class CosmoFlow(nn.Module):
    """CosmoFlow's network (Mathuriya et al. 2018, the MLPerf HPC reference): stages of
    a 3x3x3 convolution of ``conv_size * 2**i`` channels, leaky ReLU and 2x max pooling
    over a 4-channel ``size``^3 volume, then dense 128 and 64 and the 4 cosmological
    parameters regressed (tanh scaled by 1.2, MSE)."""

    def __init__(
        self, size: int = 128, channels: int = 4, conv_size: int = 32, stages: int = 5
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = channels
        for i in range(stages):
            w = conv_size * 2**i
            layers += [nn.Conv3d(c, w, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
            c = w
        side = size // 2**stages
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c * side**3, 128),
            nn.LeakyReLU(0.3),
            nn.Linear(128, 64),
            nn.LeakyReLU(0.3),
            nn.Linear(64, 4),
            nn.Tanh(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.2 * self.head(self.features(x))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
