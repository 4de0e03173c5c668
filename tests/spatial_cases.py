"""What each rank of the spatial tests runs (importable by the pool's processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dataflow.spatial.geometry import split_extent
from dataflow.spatial.module import SpatialModule


def build(layers: list[tuple[str, dict[str, Any]]], nd: int, channels: int) -> nn.Module:
    """A Sequential from a plain description, so cases pickle as data."""
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[nd - 1]
    maxp = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[nd - 1]
    avgp = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)[nd - 1]
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[nd - 1]
    out, c = [], channels
    for kind, kw in layers:
        if kind == "conv":
            out.append(conv(c, kw.pop("out"), **kw))
            c = out[-1].out_channels
        elif kind == "max":
            out.append(maxp(**kw))
        elif kind == "avg":
            out.append(avgp(**kw))
        elif kind == "bn":
            out.append(bn(c))
        elif kind == "relu":
            out.append(nn.ReLU())
        elif kind == "gap":
            out.append(
                (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[nd - 1](1)
            )
        elif kind == "flatten":
            out.append(nn.Flatten())
        elif kind == "linear":
            out.append(nn.LazyLinear(kw["out"]))
        elif kind == "drop":
            out.append(nn.Dropout(0.0))
    return nn.Sequential(*out)


def region(x: torch.Tensor, group: Any, dims: tuple[int, ...], weights: Any) -> torch.Tensor:
    for i, d in enumerate(dims):
        lo, hi = split_extent(x.shape[d], group.grid[i], weights[i] if weights else None)[
            group.coords[i]
        ]
        x = x.narrow(d, lo, hi - lo)
    return x.contiguous()


def compare(group: Any, case: dict[str, Any]) -> dict[str, float]:
    """Output and summed parameter gradients of the partitioned model against the whole
    model on the same input: the largest absolute differences (relative to scale)."""
    torch.manual_seed(case["seed"])
    model = build([(k, dict(kw)) for k, kw in case["layers"]], case["nd"], case["channels"])
    dtype = getattr(torch, case.get("dtype", "float32"))
    device = torch.device(case.get("device", "cpu"))
    torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions would differ at 1e-3
    x = torch.randn(case["shape"], dtype=dtype).to(device)
    model.to(device=device, dtype=dtype)
    model(x)  # materialise lazy layers
    model.to(device=device, dtype=dtype)
    model.train(case.get("train", True))
    part = SpatialModule(model, group, case["dims"], case.get("weights"))
    part.train(case.get("train", True))
    x.requires_grad_(True)
    # autocast="bf16": the forward under CPU autocast, as a precision="bf16" fit runs it
    # (bf16 activations, so bf16 halos)
    autocast = case.get("autocast") == "bf16"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        ref_out = model(x).float()
    probe = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7), dtype=dtype)
    probe = probe.to(device)
    (ref_out * probe).sum().backward()
    mine = region(x.detach(), group, case["dims"], case.get("weights")).requires_grad_(True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = part(mine).float()
    (out * probe).sum().backward()
    errors = {
        "output": float(
            (out.detach() - ref_out.detach()).abs().max() / (ref_out.abs().max() + 1e-6)
        )
    }
    worst = 0.0
    scale = max((float(p.grad.abs().max()) for p in model.parameters()), default=0.0) + 1e-6
    for (name, p), (_, q) in zip(model.named_parameters(), part.named_parameters(), strict=True):
        g = q.grad if q.grad is not None else torch.zeros_like(q)
        group.allreduce_(g)
        err = float((g - p.grad).abs().max()) / scale  # relative to the model's largest
        errors[f"grad:{name}"] = err
        worst = max(worst, err)
    errors["grad"] = worst
    expected = region(x.grad, group, case["dims"], case.get("weights"))
    errors["input_grad"] = float((mine.grad - expected).abs().max()) / (
        float(x.grad.abs().max()) + 1e-6
    )
    buffers = [
        (b1 - b2).abs().max().item()
        for b1, b2 in zip(model.buffers(), part.buffers(), strict=True)
        if b1.is_floating_point()
    ]
    errors["buffers"] = max(buffers, default=0.0)
    return errors


class Residual(nn.Module):
    """A residual block with a strided shortcut: a graph, not a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding="same")
        self.short = nn.Conv2d(2, 4, 1, stride=2)
        self.head = nn.Linear(4, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv1(x)))
        y = self.conv2(y) + self.short(x)
        return self.head(self.pool(y).flatten(1))


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(2 * 12, 2)
        self.drop2 = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc(self.drop(self.conv(x)).flatten(1)))


def residual(group: Any, shape: tuple[int, ...]) -> dict[str, float]:
    torch.manual_seed(3)
    model = Residual()
    part = SpatialModule(model, group, (2,))
    x = torch.randn(shape)
    ref = model(x)
    ref.sum().backward()
    out = part(region(x, group, (2,), None))
    out.sum().backward()
    worst = 0.0
    for p, q in zip(model.parameters(), part.parameters(), strict=True):
        g = q.grad.clone() if q.grad is not None else torch.zeros_like(q)
        group.allreduce_(g)
        worst = max(worst, float((g - p.grad).abs().max()))
    return {"output": float((out.detach() - ref.detach()).abs().max()), "grad": worst}


def dropout_outputs(group: Any) -> list[float]:
    """The partitioned model's output with dropout on: every rank must agree."""
    torch.manual_seed(0)
    part = SpatialModule(Dropped(), group, (2,), seed=11)
    x = torch.randn(2, 1, 12)
    return part(region(x, group, (2,), None)).detach().flatten().tolist()


def refused(group: Any, name: str) -> str:
    """The error message partitioning a model with an unsupported layer gives."""
    models = {
        "upsample": nn.Sequential(nn.Conv2d(1, 2, 3), nn.Upsample(scale_factor=2)),
        "reflect": nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")),
        "groupnorm": nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4)),
    }
    try:
        SpatialModule(models[name], group, (2,))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
