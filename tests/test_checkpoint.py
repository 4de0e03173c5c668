"""The checkpoint store: exact round trip, atomic writes (a writer killed mid-write in a
real process), corrupt files skipped and named, incompatible runs refused, pruning."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import dataflow as dfl
from dataflow.checkpoint import (
    FORMAT_VERSION,
    WRITE_DELAY_ENV,
    Checkpoint,
    CheckpointStore,
    capture_rng,
    compare_fingerprints,
    fingerprint,
    ledger_from_state,
    ledger_state,
    phase_from_dict,
    phase_to_dict,
    restore_rng,
)
from dataflow.errors import (
    CheckpointError,
    ConfigError,
    DataflowError,
    IncompatibleCheckpointError,
)
from dataflow.history.result import History
from dataflow.io.ledger import SampleLedger
from dataflow.schedule import Fixed, PhaseSpec


class Net(torch.nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, channels, 3)
        self.bn = torch.nn.BatchNorm2d(channels)
        self.fc = torch.nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv1(x)))
        h = torch.nn.functional.dropout(h.mean(dim=(2, 3)), p=0.3, training=self.training)
        return self.fc(h)


def make_source(n: int = 64) -> dfl.io.ArraySource:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
    return dfl.io.ArraySource(x, rng.integers(0, 3, n))


def train_step(model: Net, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def make_checkpoint(model: torch.nn.Module, step: int, **fields) -> Checkpoint:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Checkpoint(
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        phase_index=0,
        epoch=0,
        step=step,
        fingerprint=fingerprint(model, make_source(), {"seed": 0, "replicas": 2}),
        **fields,
    )


def test_round_trip_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Model (with BatchNorm buffers and dropout), SGD momentum, every RNG, ledger, history:
    after a restore the next steps and the next random draws equal the uninterrupted run."""
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(32, 1, 8, 8), torch.randint(0, 3, (32,))
    for _ in range(3):  # momentum buffers exist only after a step
        train_step(model, optimizer, *data)
    ledger = SampleLedger(64)
    ledger.record(0, 0, [1, 5, 9])
    ledger.record(0, 1, [2, 3])
    ledger.record(1, 1, np.arange(64))
    random.random(), np.random.random(), torch.rand(1)  # states mid-sequence
    phase = PhaseSpec(index=1, start_epoch=2, end_epoch=5, global_batch=32, lr=0.1)
    history = History(steps=[{"step": 0, "loss": np.float32(1.5)}], info={"seed": 0})
    store = CheckpointStore(tmp_path / "ckpt")
    path = store.save(
        Checkpoint(
            model_state=model.state_dict(),
            optimizer_state=optimizer.state_dict(),
            phase_index=1,
            epoch=3,
            step=17,
            schedule_state={"previous": phase_to_dict(phase)},
            ledger=ledger_state(ledger),
            rng=capture_rng(),
            history=history.to_dict(),
        )
    )
    assert path.name == "ckpt-0000000017.pt"

    # The uninterrupted run goes on...
    expected_draws = (random.random(), np.random.random(), torch.rand(3))
    expected_losses = [train_step(model, optimizer, *data) for _ in range(2)]
    expected_state = model.state_dict()

    # ... and a fresh process-like start restores into new objects.
    torch.manual_seed(123), np.random.seed(5), random.seed(7)
    restored = CheckpointStore(tmp_path / "ckpt").load_latest()
    assert restored is not None
    assert (restored.step, restored.epoch, restored.phase_index) == (17, 3, 1)
    resumed = Net(channels=8)
    resumed.load_state_dict(restored.model_state)
    resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    resumed_optimizer.load_state_dict(restored.optimizer_state)
    restore_rng(restored.rng)
    draws = (random.random(), np.random.random(), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1]
    assert torch.equal(draws[2], expected_draws[2])
    # the draws above advanced the same RNGs as the uninterrupted run's draws did
    losses = [train_step(resumed, resumed_optimizer, *data) for _ in range(2)]
    for got, want in zip(losses, expected_losses, strict=True):
        assert torch.equal(got, want)
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, expected_state[name]), name

    assert phase_from_dict(restored.schedule_state["previous"]) == phase
    assert restored.history["steps"][0]["loss"] == 1.5
    assert History(**restored.history).info == {"seed": 0}
    back = ledger_from_state(restored.ledger)
    assert back.epochs == [0, 1]
    assert back.replicas(0) == [0, 1]
    assert back.consumed(0, 0).tolist() == [1, 5, 9]
    assert back.consumed(0).tolist() == [1, 2, 3, 5, 9]
    assert len(back.consumed(1, 1)) == 64
    with pytest.raises(dfl.DataError, match="consumed twice"):
        back.record(0, 1, [5])  # the restored ledger still refuses repeats


def test_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    """The file holds tensors and plain containers only: a weights-only load reads it."""
    store = CheckpointStore(tmp_path)
    path = store.save(make_checkpoint(Net(), 3, rng=capture_rng()))
    state = torch.load(path, weights_only=True)
    assert state["step"] == 3 and state["format_version"] == FORMAT_VERSION


def test_mid_phase_progress_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    """A PhaseProgress (the phase, its steps with re-split history, the pairs, the
    per-replica totals, its seconds) saved in a checkpoint comes back equal, tuples as tuples."""
    from dataflow.checkpoint.progress import PhaseProgress, ReplicaTotals
    from dataflow.planning.plan import phase_steps, resplit_steps

    phase = PhaseSpec(index=1, start_epoch=2, end_epoch=4, global_batch=6, lr_scale=2.0)
    steps = phase_steps(num_samples=20, phase=phase, split=lambda n: (n - n // 2, n // 2))
    segment = resplit_steps(steps, 5, split=lambda n: (n,))  # re-split mid-epoch
    totals = ReplicaTotals()
    totals.add(12, {"Forward": 0.5, "Load": 0.1}, 0.7)
    progress = PhaseProgress(
        phase=phase,
        steps=steps,
        segment=segment,
        lr_factor=0.5,
        rollbacks=1,
        norm_pairs=[(3, 3, 1.5, 6, 0.5)],
        epoch_loss=(4.5, 12),
        totals=[totals],
        seconds=3.25,
    )
    store = CheckpointStore(tmp_path)
    store.save(make_checkpoint(Net(), 5, in_phase=progress.to_dict()))
    loaded = store.load_latest()
    assert loaded.mid_phase
    back = PhaseProgress.from_dict(loaded.in_phase)
    assert back.phase == phase and back.steps == steps and back.segment == segment
    assert segment[0].earlier_splits  # the nested tuples survived
    assert back.norm_pairs == progress.norm_pairs and back.epoch_loss == (4.5, 12)
    assert back.totals[0].to_dict() == totals.to_dict()
    assert back.seconds == 3.25  # the phase's wall time so far: a resume goes on from it
    older = {k: v for k, v in loaded.in_phase.items() if k != "seconds"}
    assert PhaseProgress.from_dict(older).seconds == 0.0  # written before it was kept


def test_a_format_1_checkpoint_still_loads_as_a_phase_boundary(tmp_path: Path) -> None:
    state = make_checkpoint(Net(), 2).to_dict()
    for name in ("stage_state", "replica_buffers", "in_phase"):
        del state[name]
    state["format_version"] = 1
    loaded = Checkpoint.from_dict(state)
    assert not loaded.mid_phase and loaded.step == 2


def test_checkpoint_with_retired_fields_loads(tmp_path: Path, monkeypatch) -> None:
    """Files written before balancer_measured and extra were removed still load: the
    loader ignores both keys (nothing reads them)."""
    retired = {"balancer_measured": [[120.0, 80.5]], "extra": {"tag": "old"}}
    state = {**make_checkpoint(Net(), 3).to_dict(), **retired}
    assert Checkpoint.from_dict(state).step == 3

    to_dict = Checkpoint.to_dict
    monkeypatch.setattr(Checkpoint, "to_dict", lambda self: {**to_dict(self), **retired})
    store = CheckpointStore(tmp_path)
    path = store.save(make_checkpoint(Net(), 5))  # written as an older version wrote it
    monkeypatch.undo()
    on_disk = torch.load(path, weights_only=True)
    assert on_disk["balancer_measured"] == [[120.0, 80.5]] and on_disk["extra"] == retired["extra"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded is not None and loaded.step == 5
    assert not hasattr(loaded, "balancer_measured") and not hasattr(loaded, "extra")


def test_unstorable_value_is_refused_with_its_field(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    phase = PhaseSpec(index=0, start_epoch=0, end_epoch=1, global_batch=4)
    bad = make_checkpoint(Net(), 1, schedule_state={"phase": phase})
    match = r"Checkpoint.schedule_state\['phase'\] holds a PhaseSpec"
    with pytest.raises(CheckpointError, match=match):
        store.save(bad)
    assert store.checkpoints() == []


def test_invalid_fields_name_the_field() -> None:
    with pytest.raises(ConfigError, match="step must be an int >= 0"):
        make_checkpoint(Net(), -1)
    with pytest.raises(ConfigError, match="keep must be an int >= 1"):
        CheckpointStore("/tmp", keep=0)


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the writer")
        time.sleep(0.01)


WRITER = textwrap.dedent(
    """
    import sys, torch
    from dataflow.checkpoint import Checkpoint, CheckpointStore
    big = torch.ones(16 * 2**20)  # 64 MiB
    store = CheckpointStore(sys.argv[1])
    store.save(Checkpoint(model_state={"w": big}, optimizer_state={}, phase_index=0,
                          epoch=1, step=int(sys.argv[2])))
    """
)


def test_writer_killed_mid_write_leaves_previous_checkpoint(tmp_path: Path) -> None:
    """A real process writing a large checkpoint is SIGKILLed partway: the partial file is
    never taken for a checkpoint, and resume picks the previous one."""
    store = CheckpointStore(tmp_path)
    store.save(make_checkpoint(Net(), 10))
    env = {**os.environ, WRITE_DELAY_ENV: "0.05"}  # 64 MiB at 20 MiB/s: ~3 s of writing
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "20"], env=env)
    try:

        def partial_written() -> bool:
            assert writer.poll() is None, "the writer finished or failed before it was killed"
            return any(p.stat().st_size > 2**20 for p in tmp_path.glob(".ckpt-0000000020.pt.*"))

        _wait_for(partial_written)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert not (tmp_path / "ckpt-0000000020.json").exists()
    assert list(tmp_path.glob(".ckpt-0000000020.pt.*.tmp"))  # the partial write is there
    fresh = CheckpointStore(tmp_path)
    assert fresh.latest() == tmp_path / "ckpt-0000000010.pt"
    assert fresh.load_latest().step == 10
    fresh.save(make_checkpoint(Net(), 30))  # the next save sweeps the dead write away
    assert not list(tmp_path.glob(".ckpt-*.tmp"))


def test_writer_not_killed_completes(tmp_path: Path) -> None:
    """The same writer left alone writes a valid checkpoint (the kill test's control)."""
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), "20"], check=True)
    assert CheckpointStore(tmp_path).load_latest().model_state["w"].numel() == 16 * 2**20


def test_data_without_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    """A crash after the data file's rename but before the manifest's: still invalid."""
    store = CheckpointStore(tmp_path)
    store.save(make_checkpoint(Net(), 1))
    path = store.save(make_checkpoint(Net(), 2))
    store.manifest_path(path).unlink()
    with pytest.warns(RuntimeWarning, match=r"ckpt-0000000002\.pt has no manifest"):
        assert store.latest() == tmp_path / "ckpt-0000000001.pt"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bitflip"])
def test_corrupt_checkpoint_skipped_and_refused_when_loaded(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    store.save(make_checkpoint(Net(), 1))
    path = store.save(make_checkpoint(Net(), 2))
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    else:
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(flipped))
    fresh = CheckpointStore(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"ckpt-0000000002\.pt is corrupt"):
        assert fresh.latest() == tmp_path / "ckpt-0000000001.pt"
    with pytest.warns(RuntimeWarning, match=r"ckpt-0000000002\.pt is corrupt"):
        assert fresh.load_latest().step == 1
    with pytest.raises(CheckpointError, match=r"ckpt-0000000002\.pt is corrupt") as error:
        fresh.load(path)
    assert isinstance(error.value, OSError) and isinstance(error.value, DataflowError)


def test_garbage_file_with_matching_manifest_is_refused(tmp_path: Path) -> None:
    """A file that passes the checksum but is no checkpoint (not written by the store)."""
    store = CheckpointStore(tmp_path)
    path = store.save(make_checkpoint(Net(), 5))
    path.write_bytes(b"not a zip file at all")
    manifest = json.loads(store.manifest_path(path).read_text())
    import hashlib

    manifest["blake2b"] = hashlib.blake2b(path.read_bytes()).hexdigest()
    store.manifest_path(path).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"ckpt-0000000005\.pt matches its checksum but"):
        CheckpointStore(tmp_path).load(path)


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "new" / "dir")
    assert store.latest() is None and store.load_latest() is None


def test_incompatible_checkpoint_lists_every_difference(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(make_checkpoint(Net(channels=8), 4))
    current = fingerprint(Net(channels=16), make_source(32), {"seed": 0, "replicas": 2})
    with pytest.raises(IncompatibleCheckpointError) as error:
        store.load_latest(expect=current)
    message = str(error.value)
    assert isinstance(error.value, ValueError) and isinstance(error.value, DataflowError)
    assert "ckpt-0000000004.pt belongs to another run" in message
    assert (
        "model: parameter conv1.weight has shape (8, 1, 3, 3) in the checkpoint but "
        "(16, 1, 3, 3) now" in message
    )
    assert "model: buffer bn.running_mean has shape (8,) in the checkpoint but (16,)" in message
    assert "data: the source has 64 samples in the checkpoint but 32 now" in message
    assert "data: array x ('x') has shape (64, 1, 8, 8) in the checkpoint but (32, 1, 8, 8)" in (
        message
    )
    assert "another checkpoint_dir" in message and "resume=False" in message
    # The matching fit resumes.
    same = fingerprint(Net(channels=8), make_source(64), {"seed": 0, "replicas": 2})
    assert store.load_latest(expect=same).step == 4


def test_compare_fingerprints_config_and_dtype() -> None:
    model = Net()
    source = make_source()
    saved = fingerprint(model, source, {"seed": 0, "replicas": 2, "schedule": Fixed(16)})
    assert compare_fingerprints(saved, saved) == []
    current = fingerprint(
        Net().double(),
        dfl.io.ArraySource(source.x.double(), source.y, shuffle=False),
        {"seed": 1, "replicas": 2, "schedule": Fixed(32)},
    )
    differences = compare_fingerprints(saved, current)
    assert "config: seed is 0 in the checkpoint but 1 now" in differences
    assert f"config: schedule is {Fixed(16)!r} in the checkpoint but {Fixed(32)!r} now" in (
        differences
    )
    assert (
        "model: parameter fc.weight has dtype torch.float32 in the checkpoint but "
        "torch.float64 now" in differences
    )
    assert "data: array x ('x') has dtype float32 in the checkpoint but float64 now" in differences
    assert "data: shuffle is True in the checkpoint but False now" in differences
    assert not any("replicas" in d for d in differences)


def test_fingerprint_of_zarr_source(tmp_path: Path) -> None:
    x = np.zeros((40, 1, 4, 4), np.float32)
    y = np.zeros(40, np.int64)
    store = dfl.io.to_zarr(tmp_path / "d.zarr", x, y, x_name="density", y_name="label")
    source = dfl.io.ZarrSource(store, x="density", y="label")
    arrays = fingerprint(Net(), source, {})["data"]["arrays"]
    assert arrays["x"] == {"name": "density", "shape": [40, 1, 4, 4], "dtype": "float32"}
    assert arrays["y"]["dtype"] == "int64"
    # an ArraySource over the same arrays gives the same data fingerprint
    same = fingerprint(Net(), dfl.io.ArraySource(x, y), {})["data"]
    assert [a["shape"] for a in same["arrays"].values()] == [
        a["shape"] for a in fingerprint(Net(), source, {})["data"]["arrays"].values()
    ]


def test_unwritable_directory_is_refused_at_construction(tmp_path: Path) -> None:
    """A directory without write permission is refused when the store is built. Root
    writes through ``chmod 500``, so under root (this machine, CI) the check runs in a
    child that imports the store, then drops to the unprivileged user ``nobody``."""
    if os.geteuid() != 0:
        directory = tmp_path / "ro"
        directory.mkdir()
        directory.chmod(0o500)
        try:
            with pytest.raises(CheckpointError, match="is not writable") as error:
                CheckpointStore(directory)
            assert str(directory) in str(error.value) and "chmod" in str(error.value)
        finally:
            directory.chmod(0o700)
        return
    child = textwrap.dedent(
        """
        import os, tempfile
        from dataflow.checkpoint.store import CheckpointStore
        from dataflow.errors import CheckpointError
        os.setgid(65534)
        os.setuid(65534)  # nobody: from here on, permissions apply
        directory = os.path.join(tempfile.mkdtemp(), "ro")
        os.mkdir(directory)
        os.chmod(directory, 0o500)
        try:
            CheckpointStore(directory)
        except CheckpointError as error:
            assert directory in str(error) and "chmod" in str(error), error
            print("refused:", error)
        else:
            raise SystemExit("an unwritable directory was accepted")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, cwd="/", timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "is not writable" in done.stdout, done.stdout


def test_directory_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    """Under a regular file no directory can be made, even as root."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="is not writable") as error:
        CheckpointStore(blocker / "ckpt")
    assert isinstance(error.value, OSError)
    assert str(blocker / "ckpt") in str(error.value)


def test_pruning_keeps_newest_valid(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        store.save(make_checkpoint(Net(), step))
    assert [p.name for p in store.checkpoints()] == ["ckpt-0000000004.pt", "ckpt-0000000003.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-0000000003.json",
        "ckpt-0000000003.pt",
        "ckpt-0000000004.json",
        "ckpt-0000000004.pt",
    ]
    # A corrupt one does not count towards keep: two valid ones stay, and the corrupt
    # one, newer than the oldest kept, stays for latest() to name.
    path = store.save(make_checkpoint(Net(), 5))
    path.write_bytes(b"x")
    store.save(make_checkpoint(Net(), 6))
    fresh = CheckpointStore(tmp_path, keep=2)
    assert [p.name for p in fresh.checkpoints()] == ["ckpt-0000000006.pt", "ckpt-0000000004.pt"]
    assert not (tmp_path / "ckpt-0000000003.pt").exists()
    assert (tmp_path / "ckpt-0000000005.pt").exists()
    store.clear()
    assert list(tmp_path.iterdir()) == []


def test_resave_of_same_step_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(make_checkpoint(Net(), 7, stage_state={"tag": "first"}))
    store.save(make_checkpoint(Net(), 7, stage_state={"tag": "second"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load_latest().stage_state == {"tag": "second"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rng_round_trip(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(3)
    torch.rand(1, device="cuda")  # CUDA in use: its states are captured
    store = CheckpointStore(tmp_path)
    store.save(make_checkpoint(Net(), 1, rng=capture_rng()))
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(99)
    restore_rng(store.load_latest().rng)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_history_steps_are_appended_once_and_read_back(tmp_path: Path) -> None:
    """Format 3: a checkpoint holds how many history steps it covers; the steps are in
    the store's steps file, written once each, and come back on load. A fit that goes
    back to an older checkpoint drops the later lines."""
    store = CheckpointStore(tmp_path, keep=10)
    steps = [{"step": i, "loss": float("nan") if i == 2 else float(i)} for i in range(6)]
    assert store.append_steps(0, steps[:4]) == 4
    first = make_checkpoint(Net(), 4, history={"epochs": [], "steps_in_file": 4})
    store.save(first)
    assert store.append_steps(4, steps[4:]) == 6
    assert len(store.steps_path.read_text().splitlines()) == 6
    loaded = store.load(store.path(4))
    assert [s["step"] for s in loaded.history["steps"]] == [0, 1, 2, 3]
    assert np.isnan(loaded.history["steps"][2]["loss"])  # NaN stays a float
    again = CheckpointStore(tmp_path, keep=10)  # a resumed fit: back to step 4
    assert again.append_steps(4, [{"step": 4, "loss": 9.0}]) == 5
    assert [s["loss"] for s in again._read_steps(5)][-1] == 9.0


def test_a_restored_optimizer_keeps_the_factorys_options_and_the_checkpoints_state():
    """Resuming with an edited optimizer factory (another weight decay, or SGD's state
    into FusedLARS) trains with the factory's options, not silently with the saved ones;
    the state (momentum) and the LR (the schedule's) come from the checkpoint."""
    from dataflow.ops import FusedLARS
    from dataflow.runtime.replica_state import load_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    saved_opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=0.0)
    model(torch.randn(4, 3)).sum().backward()
    saved_opt.step()
    saved = saved_opt.state_dict()
    for make in (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, weight_decay=1e-3),
        lambda p: FusedLARS(p, lr=0.1, momentum=0.5, weight_decay=1e-3, trust_coefficient=0.02),
    ):
        live = make(model.parameters())
        load_optimizer_state(live, saved)
        (group,) = live.param_groups
        assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.3, 0.5, 1e-3)
        for i, p in enumerate(model.parameters()):
            expected = saved["state"][i]["momentum_buffer"]
            assert torch.equal(live.state[p]["momentum_buffer"], expected)
        if isinstance(live, FusedLARS):
            assert group["trust_coefficient"] == 0.02
