"""Checkpoint write and resume time, and file size, for a ResNet-50-sized model.

The model is ResNet-50 built by hand (torchvision's layout: 25,557,032 parameters in 161
tensors, plus BatchNorm's running statistics, 320 state-dict entries), with SGD
(momentum 0.9, weight decay 1e-4) after one step, so the optimizer holds a momentum
buffer per parameter. The checkpoint is what a fit writes: model and optimizer state,
the RNG states, a sample ledger (ImageNet-sized by default: 1,281,167 samples, 4
replicas, 3 epochs) and the fingerprint.

Timed, round-robin over ``--rounds`` rounds (median reported), all in one process:

* **save**: ``CheckpointStore.save`` (``Checkpoint.to_dict``, ``torch.save`` through
  the hashing writer, fsync, atomic rename, directory fsync, JSON manifest, prune);
* **baseline save**: ``torch.save`` of the same dict to a plain file, without and with an
  ``fsync`` (what a script that saves a state dict does, and the same made durable);
* **load**: ``CheckpointStore(dir).load_latest(expect=fingerprint)`` (read, blake2b
  check against the manifest, ``torch.load(weights_only=True)``, fingerprint compare);
* **baseline load**: ``torch.load(weights_only=True)`` of the baseline file;
* **resume**: load plus ``load_state_dict`` into a fresh model and optimizer;
* **resume past a corrupt newest**: the newest checkpoint truncated; ``load_latest``
  reads and rejects it (a ``RuntimeWarning``), then loads the previous one.

Files are written to ``--dir`` (default: a temporary folder under /tmp, the local disk
here) and read back while still in the page cache: warm reads, like a resume right
after a failure on the same node; a cold read from a parallel file system is slower.

    python benchmarks/bench_checkpoint.py              # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from quiet import wait_quiet
from records import save_run, table

import dataflow as dfl
from dataflow.checkpoint import (
    Checkpoint,
    CheckpointStore,
    capture_rng,
    fingerprint,
    ledger_state,
)
from dataflow.io.ledger import SampleLedger

NAME = "checkpoint"
MIB = 2**20


# -- ResNet-50 ---------------------------------------------------------------------------


class Bottleneck(torch.nn.Module):
    def __init__(self, inplanes: int, width: int, stride: int) -> None:
        super().__init__()
        out = 4 * width
        self.conv1 = torch.nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.conv3 = torch.nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = torch.nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = torch.nn.Sequential(
                torch.nn.Conv2d(inplanes, out, 1, stride, bias=False), torch.nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(torch.nn.Module):
    """torchvision's resnet50 layout (the same parameter names, shapes and count)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(64)
        self.maxpool = torch.nn.MaxPool2d(3, 2, 1)
        inplanes = 64
        for i, (width, blocks, stride) in enumerate(
            ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), start=1
        ):
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(inplanes, width, stride if b == 0 else 1))
                inplanes = 4 * width
            setattr(self, f"layer{i}", torch.nn.Sequential(*layer))
        self.avgpool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """ResNet-50 and SGD with momentum, after one step (the momentum buffers exist)."""
    torch.manual_seed(seed)
    model = ResNet50()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def make_ledger(samples: int, replicas: int, epochs: int) -> SampleLedger:
    ledger = SampleLedger(samples)
    rng = np.random.default_rng(0)
    for epoch in range(epochs):
        for replica, part in enumerate(np.array_split(rng.permutation(samples), replicas)):
            ledger.record(epoch, replica, part)
    return ledger


def make_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    args: Any,
    expect: dict,
    ledger: SampleLedger,
) -> Checkpoint:
    return Checkpoint(
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        phase_index=args.ledger_epochs,
        epoch=args.ledger_epochs,
        step=step,
        ledger=ledger_state(ledger),
        rng=capture_rng(),
        replica_rng=[capture_rng() for _ in range(args.replicas)],
        fingerprint=expect,
    )


# -- timing --------------------------------------------------------------------------------


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def torch_save(state: dict, path: Path, *, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def resume(
    directory: Path, expect: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Checkpoint:
    """What a resumed fit does with the newest checkpoint: load it (verified, fingerprint
    compared) and put its weights and momentum into the model and optimizer."""
    checkpoint = CheckpointStore(directory).load_latest(expect)
    model.load_state_dict(checkpoint.model_state)
    optimizer.load_state_dict(checkpoint.optimizer_state)
    return checkpoint


def resume_past_corrupt(directory: Path, expect: dict, newest: Path, previous_step: int) -> float:
    """Truncate the newest checkpoint; load_latest must skip it and load the previous one.
    The file is put back as it was (content and mtime: the store's verified cache holds)."""
    stat = newest.stat()
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seconds, checkpoint = timed(lambda: CheckpointStore(directory).load_latest(expect))
    assert checkpoint.step == previous_step, checkpoint.step
    assert any("is corrupt" in str(w.message) for w in caught), [str(w.message) for w in caught]
    newest.write_bytes(data)  # restored: the manifest's checksum matches again
    os.utime(newest, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return seconds


def one_round(
    store: CheckpointStore,
    checkpoint: Checkpoint,
    plain_dir: Path,
    expect: dict,
    sizes: dict,
    rotation: int,
) -> dict[str, float]:
    """Each operation once; seconds by operation (``sizes`` filled in). The three writes
    run in an order rotated by ``rotation`` (no variant always goes first), each to a
    new file, as a fit's saves do; the older baseline files are deleted untimed."""
    times: dict[str, float] = {}
    times["to_dict"], state = timed(checkpoint.to_dict)
    step = checkpoint.step
    plain, synced = plain_dir / f"state-{step}.pt", plain_dir / f"synced-{step}.pt"
    writes = {
        "save": lambda: store.save(checkpoint),
        "torch_save": lambda: torch_save(state, plain, fsync=False),
        "torch_save_fsync": lambda: torch_save(state, synced, fsync=True),
    }
    order = list(writes)
    order = order[rotation % 3 :] + order[: rotation % 3]
    for name in order:
        times[name], _ = timed(writes[name])
    for old in plain_dir.iterdir():
        if old not in (plain, synced):
            old.unlink()
    path = store.path(step)
    sizes["checkpoint"] = path.stat().st_size
    sizes["manifest"] = store.manifest_path(path).stat().st_size
    sizes["torch_save"] = plain.stat().st_size
    times["blake2b"], _ = timed(lambda: hashlib.blake2b(path.read_bytes()).hexdigest())
    times["load"], loaded = timed(lambda: CheckpointStore(store.directory).load_latest(expect))
    assert loaded.step == step
    times["torch_load"], _ = timed(lambda: torch.load(plain, map_location="cpu", weights_only=True))
    model = ResNet50()  # built before the clock starts: a resume builds its model anyway
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    times["resume"], _ = timed(lambda: resume(store.directory, expect, model, optimizer))
    previous = [c for c in store.checkpoints() if c != path]
    if previous:  # there is an older checkpoint to fall back to
        older = int(previous[0].stem.split("-")[1])
        times["resume_past_corrupt"] = resume_past_corrupt(store.directory, expect, path, older)
    return times


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="folder to write in (default: a temporary one)")
    p.add_argument("--ledger-samples", type=int, default=1_281_167)
    p.add_argument("--ledger-epochs", type=int, default=3)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--max-wait", type=float, default=60.0, help="wait up to this long for a quiet machine"
    )
    p.add_argument("--out", default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    others = wait_quiet(args.max_wait)  # cores other programs use, when we start
    start_uptime, start_load = uptime(), load_average()
    print(f"machine load at start: {start_uptime}; other programs use {others:.2f} cores")

    model, optimizer = model_and_optimizer()
    parameters = sum(p.numel() for p in model.parameters())
    source = dfl.io.ArraySource(np.zeros((8, 3, 32, 32), np.float32), np.zeros(8, np.int64))
    config = {"seed": 0, "replicas": args.replicas, "schedule": dfl.schedule.Fixed(256)}
    expect = fingerprint(model, source, config)
    base = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    plain_dir = base / "plain"
    plain_dir.mkdir()
    store = CheckpointStore(base / "store", keep=2)
    tensors_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / MIB
    momentum_mib = (
        sum(s["momentum_buffer"].numel() * 4 for s in optimizer.state_dict()["state"].values())
        / MIB
    )
    print(
        f"ResNet-50: {parameters:,} parameters, model state {tensors_mib:.1f} MiB, "
        f"momentum {momentum_mib:.1f} MiB; ledger {args.ledger_samples:,} samples x "
        f"{args.replicas} replicas x {args.ledger_epochs} epochs; writing to {base}"
    )

    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    ledger = make_ledger(args.ledger_samples, args.replicas, args.ledger_epochs)
    try:
        for r in range(args.rounds):
            checkpoint = make_checkpoint(model, optimizer, 100 * (r + 1), args, expect, ledger)
            measured = one_round(store, checkpoint, plain_dir, expect, sizes, rotation=r)
            for key, seconds in measured.items():
                times.setdefault(key, []).append(seconds)
            print(
                f"round {r + 1}/{args.rounds}: save {measured['save']:.3f} s, torch.save "
                f"{measured['torch_save']:.3f} s (+fsync {measured['torch_save_fsync']:.3f} s), "
                f"load {measured['load']:.3f} s, torch.load {measured['torch_load']:.3f} s"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items() if v}
    size_mib = sizes["checkpoint"] / MIB
    ratios = {
        "save_over_torch_save": med["save"] / med["torch_save"],
        "save_over_torch_save_fsync": med["save"] / med["torch_save_fsync"],
        "load_over_torch_load": med["load"] / med["torch_load"],
        "size_over_torch_save": sizes["checkpoint"] / sizes["torch_save"],
    }

    def row(label: str, key: str, rate: bool = True) -> list[str]:
        return [label, f"{med[key]:.3f}", f"{size_mib / med[key]:.0f}" if rate else ""]

    rows = [
        row("CheckpointStore.save", "save"),
        row("  of which Checkpoint.to_dict", "to_dict", rate=False),
        row("torch.save (baseline)", "torch_save"),
        row("torch.save + fsync (baseline)", "torch_save_fsync"),
        row("read + blake2b of the file (alone)", "blake2b"),
        row("load_latest(expect=fingerprint)", "load"),
        row("torch.load (baseline)", "torch_load"),
        row("resume (load + load_state_dict x2)", "resume", rate=False),
    ]
    if "resume_past_corrupt" in med:
        rows.append(row("load_latest past a corrupt newest", "resume_past_corrupt", rate=False))
    print()
    print(table(rows, ["operation (median)", "seconds", "MiB/s"]))
    print(
        f"\ncheckpoint file {size_mib:.1f} MiB (+ {sizes['manifest']} B manifest); torch.save of "
        f"the same dict {sizes['torch_save'] / MIB:.1f} MiB"
    )
    print(
        f"ratios: save / torch.save {ratios['save_over_torch_save']:.2f}, save / (torch.save + "
        f"fsync) {ratios['save_over_torch_save_fsync']:.2f}, load_latest / torch.load "
        f"{ratios['load_over_torch_load']:.2f}"
    )
    end_uptime, end_load = uptime(), load_average()
    print(f"machine load at end: {end_uptime}")
    run = {
        "config": {
            "parameters": parameters,
            "model_state_mib": round(tensors_mib, 2),
            "momentum_mib": round(momentum_mib, 2),
            "ledger_samples": args.ledger_samples,
            "ledger_epochs": args.ledger_epochs,
            "replicas": args.replicas,
            "rounds": args.rounds,
            "torch_threads": args.threads,
            "directory": str(Path(args.dir or tempfile.gettempdir()).resolve()),
        },
        "median_seconds": {k: round(v, 4) for k, v in med.items()},
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "bytes": sizes,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "load_average_start": start_load,
        "load_average_end": end_load,
        "uptime_start": start_uptime,
        "uptime_end": end_uptime,
        "other_programs_cores_at_start": round(others, 2),
    }
    print(f"saved {save_run(NAME, run, args.out, overwrite=args.overwrite)}")


if __name__ == "__main__":
    main()
