"""Checkpoints: everything a fit needs to resume exactly, written so a crash never
leaves one that looks valid.

A :class:`Checkpoint` holds tensors and plain containers only (numbers, strings,
lists, tuples, dicts), so it loads with ``torch.load(weights_only=True)``: opening a
checkpoint never runs code from the file. :class:`CheckpointStore` writes each one
to a temporary file, fsyncs it, renames it into place, then writes a JSON manifest
with the file's blake2b checksum the same way; a checkpoint counts only when its
manifest exists and the checksum matches, so a write cut short at any point leaves
the previous checkpoint as the newest valid one.

:func:`fingerprint` records what must match to resume (the model's parameter names,
shapes and dtypes, the dataset's size and arrays, the seed, the replica count, the
schedule); :func:`compare_fingerprints` says what differs, in words.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import re
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dataflow.errors import CheckpointError, ConfigError, IncompatibleCheckpointError

FORMAT_VERSION = 2  # 2: mid-phase checkpoints (in_phase, stage_state, replica_buffers)
NAME = re.compile(r"^ckpt-(\d{10})\.pt$")
TEMP_SUFFIX = ".tmp"
MAX_LISTED_DIFFERENCES = 25  # in an error message; compare_fingerprints returns them all
# Test hook: seconds to sleep after each MiB written, so a test can kill a writer
# mid-write from another process. Never set it outside tests.
WRITE_DELAY_ENV = "DATAFLOW_CHECKPOINT_WRITE_DELAY_S"
_MIB = 2**20


# -- the checkpoint ----------------------------------------------------------------------
@dataclass(kw_only=True)
class Checkpoint:
    """The state of a fit at the start of global step ``step`` (nothing of it run yet).

    ``schedule_state``: ``{"previous": phase_to_dict(previous PhaseSpec) or None, ...}``
    plus the state dicts of any schedule helper (e.g. ``"noise": tracker.state_dict()``).
    ``balancer_measured``: per finished phase, each replica's samples/s (what the
    balancer splits the next phase by). ``ledger``: :func:`ledger_state`. ``rng``: the
    driver's :func:`capture_rng`; ``replica_rng``: one :func:`capture_rng` per replica,
    taken on its worker. ``extra``: anything else plain the driver wants back.

    ``stage_state``: rank 0's stage settings (:meth:`Stage.phase_state`, e.g. the LR
    ramp); ``replica_buffers``: each replica's buffers (BatchNorm statistics, which
    differ between replicas until a phase ends). ``in_phase``: None at a phase
    boundary; mid-phase, where the fit stands inside the phase
    (:class:`dataflow.progress.PhaseProgress`).
    """

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    phase_index: int
    epoch: int
    step: int
    schedule_state: dict[str, Any] = field(default_factory=dict)
    balancer_measured: list[list[float]] = field(default_factory=list)
    ledger: dict[str, Any] | None = None
    rng: dict[str, Any] = field(default_factory=dict)
    replica_rng: list[dict[str, Any]] = field(default_factory=list)
    history: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    stage_state: dict[str, Any] = field(default_factory=dict)
    replica_buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    in_phase: dict[str, Any] | None = None
    created: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("phase_index", "epoch", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"Checkpoint: {name} must be an int >= 0, got {value!r}")
        if not isinstance(self.model_state, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in self.model_state.values()
        ):
            raise ConfigError(
                "Checkpoint: model_state must be a state_dict (names -> tensors), e.g. "
                "model.state_dict()"
            )
        if not isinstance(self.optimizer_state, Mapping):
            raise ConfigError(
                f"Checkpoint: optimizer_state must be optimizer.state_dict(), got "
                f"{type(self.optimizer_state).__name__}"
            )
        for name in ("schedule_state", "rng", "history", "fingerprint", "extra", "stage_state"):
            if not isinstance(getattr(self, name), Mapping):
                raise ConfigError(f"Checkpoint: {name} must be a dict")
        if self.in_phase is not None and not isinstance(self.in_phase, Mapping):
            raise ConfigError("Checkpoint: in_phase must be None or a dict")

    @property
    def mid_phase(self) -> bool:
        """Written inside a phase (every N windows, or before WorkerLostError)."""
        return self.in_phase is not None

    def to_dict(self) -> dict[str, Any]:
        """Plain containers and tensors only (what ``torch.load(weights_only=True)`` reads);
        raises ``CheckpointError`` naming the first field that holds anything else."""
        return {f.name: _plain(getattr(self, f.name), f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], *, source: str = "checkpoint") -> Checkpoint:
        version = state.get("format_version") if isinstance(state, Mapping) else None
        if not isinstance(version, int):
            raise CheckpointError(f"{source} is not a dataflow checkpoint (no format_version)")
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format version {version}, newer than this dataflow reads "
                f"({FORMAT_VERSION}); upgrade dataflow to resume from it"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in state.items() if k in names})
        except (TypeError, ConfigError) as error:
            raise CheckpointError(f"{source} is malformed: {error}") from error


def _plain(value: Any, where: str) -> Any:
    """``value`` with numpy scalars and arrays made Python numbers and lists; refuses
    anything a weights-only load could not read back."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, torch.dtype | torch.Size | torch.device):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise CheckpointError(
        f"Checkpoint.{where} holds a {type(value).__name__}, which a checkpoint cannot store "
        "safely; convert it to numbers, strings, lists, dicts or tensors (for a PhaseSpec: "
        "dataflow.checkpoint.phase_to_dict)"
    )


# -- helpers for the state that is not a plain dict --------------------------------------
def phase_to_dict(phase: Any) -> dict[str, Any] | None:
    """A PhaseSpec (or any dataclass) as a dict of its fields; None stays None."""
    return None if phase is None else dataclasses.asdict(phase)


def phase_from_dict(state: Mapping[str, Any] | None) -> Any:
    """The PhaseSpec that :func:`phase_to_dict` saved (None stays None)."""
    from dataflow.schedule import PhaseSpec  # the schedule module imports more than we need

    return None if state is None else PhaseSpec(**state)


def steps_to_list(steps: Any) -> list[dict[str, Any]]:
    """StepSpecs as dicts of plain values (tuples stay tuples)."""
    return [dataclasses.asdict(spec) for spec in steps]


def steps_from_list(items: Any) -> tuple[Any, ...]:
    """The StepSpecs :func:`steps_to_list` saved."""
    from dataflow.stages.base import StepSpec

    def tuples(value: Any) -> Any:
        return tuple(tuples(v) for v in value) if isinstance(value, list | tuple) else value

    return tuple(StepSpec(**{key: tuples(value) for key, value in item.items()}) for item in items)


def ledger_state(ledger: Any) -> dict[str, Any]:
    """A SampleLedger as packed bitmaps (one bit per sample per epoch and replica),
    through its public API: ``num_samples``, ``epochs``, ``replicas(e)``, ``consumed(e, r)``."""
    records = []
    for epoch in ledger.epochs:
        for replica in ledger.replicas(epoch):
            mask = np.zeros(ledger.num_samples, dtype=bool)
            mask[ledger.consumed(epoch, replica)] = True
            records.append((int(epoch), int(replica), torch.from_numpy(np.packbits(mask))))
    return {"num_samples": int(ledger.num_samples), "records": records}


def ledger_from_state(state: Mapping[str, Any]) -> Any:
    """The SampleLedger that :func:`ledger_state` saved."""
    from dataflow.io.ledger import SampleLedger

    ledger = SampleLedger(int(state["num_samples"]))
    for epoch, replica, packed in state["records"]:
        mask = np.unpackbits(packed.numpy(), count=ledger.num_samples).astype(bool)
        ledger.record(epoch, replica, np.flatnonzero(mask))
    return ledger


def capture_rng() -> dict[str, Any]:
    """This process's global random states: torch CPU, numpy's global RandomState,
    Python's ``random``, and each CUDA device's when CUDA is in use here."""
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [state.clone() for state in torch.cuda.get_rng_state_all()]
    return {
        "torch": torch.get_rng_state().clone(),
        "numpy": (str(kind), torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
        "cuda": cuda,
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the global random states :func:`capture_rng` captured."""
    torch.set_rng_state(state["torch"])
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            warnings.warn(
                f"the checkpoint has the random states of {len(cuda)} CUDA device(s) but "
                f"this process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
                "; CUDA random draws (dropout on GPU) will not repeat those of the saved run",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            torch.cuda.set_rng_state_all(cuda)


# -- fingerprints ------------------------------------------------------------------------
def fingerprint(model: torch.nn.Module, source: Any, config: Mapping[str, Any]) -> dict:
    """What must match to resume: the model's tensors (names, shapes, dtypes, not values),
    the source's sample count, arrays and shuffle flag, and ``config`` (pass at least
    ``seed``, ``replicas`` and ``schedule``; values that are not plain are kept as repr).
    Plain JSON types only, so the manifest can hold it too."""
    parameters = {name for name, _ in model.named_parameters()}
    tensors = {
        name: {
            "kind": "parameter" if name in parameters else "buffer",
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
        }
        for name, tensor in model.state_dict().items()
    }
    return {
        "model": tensors,
        "data": _data_fingerprint(source),
        "config": {str(k): _config_value(v) for k, v in config.items()},
    }


def _config_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(
        v is None or isinstance(v, bool | int | float | str) for v in value
    ):
        return list(value)
    return {"repr": repr(value)}  # compared by repr, shown without quotes


def _describe(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"repr"}:
        return str(value["repr"])
    return repr(value)


def _data_fingerprint(source: Any) -> dict[str, Any]:
    arrays: dict[str, Any] = {}
    readers = source._open() if callable(getattr(source, "_open", None)) else None  # ZarrSource
    if readers:
        for reader in readers:
            arrays[reader.field] = {
                "name": str(reader.name),
                "shape": [int(s) for s in reader.shape],
                "dtype": str(np.dtype(reader.dtype)),
            }
    else:  # ArraySource (tensors x and y) or any source with array attributes
        for name in ("x", "y"):
            array = getattr(source, name, None)
            if hasattr(array, "shape") and hasattr(array, "dtype"):
                dtype = array.dtype
                arrays[name] = {
                    "name": name,
                    "shape": [int(s) for s in array.shape],
                    "dtype": str(dtype).replace("torch.", "")
                    if isinstance(dtype, torch.dtype)
                    else str(np.dtype(dtype)),
                }
    shuffle = getattr(source, "shuffle", None)
    return {
        "num_samples": int(source.num_samples),
        "arrays": arrays,
        "shuffle": shuffle if isinstance(shuffle, bool) else None,
    }


def _shape(value: Any) -> str:
    return str(tuple(value))


def compare_fingerprints(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Every difference between two fingerprints, one sentence each (empty: compatible)."""
    out: list[str] = []
    old_model, new_model = saved.get("model", {}), current.get("model", {})
    for name in old_model.keys() | new_model.keys():
        old, new = old_model.get(name), new_model.get(name)
        kind = (old or new)["kind"]
        if new is None:
            out.append(f"model: {kind} {name} is in the checkpoint but not in the model now")
        elif old is None:
            out.append(f"model: {kind} {name} is in the model now but not in the checkpoint")
        else:
            if old["shape"] != new["shape"]:
                out.append(
                    f"model: {kind} {name} has shape {_shape(old['shape'])} in the checkpoint "
                    f"but {_shape(new['shape'])} now"
                )
            if old["dtype"] != new["dtype"]:
                out.append(
                    f"model: {kind} {name} has dtype {old['dtype']} in the checkpoint but "
                    f"{new['dtype']} now"
                )
    out.sort()  # set order is arbitrary; sorted names read better and test stably

    old_data, new_data = saved.get("data", {}), current.get("data", {})
    if old_data.get("num_samples") != new_data.get("num_samples"):
        out.append(
            f"data: the source has {old_data.get('num_samples')} samples in the checkpoint "
            f"but {new_data.get('num_samples')} now"
        )
    if old_data.get("shuffle") != new_data.get("shuffle"):
        out.append(
            f"data: shuffle is {old_data.get('shuffle')} in the checkpoint but "
            f"{new_data.get('shuffle')} now"
        )
    old_arrays, new_arrays = old_data.get("arrays", {}), new_data.get("arrays", {})
    for key in sorted(old_arrays.keys() | new_arrays.keys()):
        old, new = old_arrays.get(key), new_arrays.get(key)
        if new is None:
            out.append(f"data: array {key} ({old['name']!r}) is in the checkpoint but not now")
        elif old is None:
            out.append(f"data: array {key} ({new['name']!r}) is read now but not in the checkpoint")
        else:
            label = f"array {key} ({new['name']!r})"
            if old["name"] != new["name"]:
                out.append(
                    f"data: array {key} is {old['name']!r} in the checkpoint but {new['name']!r} "
                    "now"
                )
            if old["shape"] != new["shape"]:
                out.append(
                    f"data: {label} has shape {_shape(old['shape'])} in the checkpoint but "
                    f"{_shape(new['shape'])} now"
                )
            if old["dtype"] != new["dtype"]:
                out.append(
                    f"data: {label} has dtype {old['dtype']} in the checkpoint but "
                    f"{new['dtype']} now"
                )

    old_config, new_config = saved.get("config", {}), current.get("config", {})
    for key in sorted(old_config.keys() | new_config.keys()):
        if key not in new_config:
            out.append(
                f"config: {key} is {_describe(old_config[key])} in the checkpoint but not given now"
            )
        elif key not in old_config:
            out.append(
                f"config: {key} is {_describe(new_config[key])} now but not in the checkpoint"
            )
        elif old_config[key] != new_config[key]:
            out.append(
                f"config: {key} is {_describe(old_config[key])} in the checkpoint but "
                f"{_describe(new_config[key])} now"
            )
    return out


# -- the store ---------------------------------------------------------------------------
class CheckpointStore:
    """Checkpoints of one run in ``directory``, as ``ckpt-<step>.pt`` + ``ckpt-<step>.json``.

    One writer per directory. ``save`` keeps the ``keep`` newest valid checkpoints;
    ``latest``/``load_latest`` skip corrupt or partial ones with a warning.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(
                f"CheckpointStore(keep={keep!r}): keep must be an int >= 1 (how many of the "
                "newest checkpoints to keep on disk)"
            )
        self.directory = Path(directory)
        self.keep = keep
        self._verified: dict[Path, tuple[int, int]] = {}  # path -> (size, mtime_ns) checked
        self._probe()

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r}, keep={self.keep})"

    def _probe(self) -> None:
        """Create the directory and write a file in it now, so an unwritable checkpoint
        directory fails at the start of a fit, not hours later at the first save."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".probe-") as probe:
                probe.write(b"dataflow")
                probe.flush()
        except OSError as error:
            raise CheckpointError(
                f"checkpoint directory {str(self.directory)!r} is not writable "
                f"({error.strerror or error}); give checkpoint_dir a directory you can write "
                f"to, or fix its permissions (e.g. chmod u+w {self.directory})"
            ) from error

    # -- paths ---------------------------------------------------------------------
    def path(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:010d}.pt"

    @staticmethod
    def manifest_path(path: Path) -> Path:
        return path.with_suffix(".json")

    def _candidates(self) -> list[tuple[int, Path]]:
        """Data files by step, newest first (valid or not)."""
        found = []
        for entry in self.directory.iterdir():
            match = NAME.match(entry.name)
            if match:
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    # -- writing -------------------------------------------------------------------
    def save(self, checkpoint: Checkpoint) -> Path:
        """Write ``checkpoint`` atomically as ``ckpt-<step>.pt`` and its manifest; prune."""
        if not isinstance(checkpoint, Checkpoint):
            raise ConfigError(
                f"CheckpointStore.save expects a Checkpoint, got {type(checkpoint).__name__}"
            )
        state = checkpoint.to_dict()
        path = self.path(checkpoint.step)
        manifest = self.manifest_path(path)
        try:
            # A re-save of the same step: drop the old manifest first, so until the new one
            # is in place the step has no valid checkpoint (never old manifest + new data).
            manifest.unlink(missing_ok=True)
            digest, size = self._write(path, lambda f: torch.save(state, f))
            record = {
                "format_version": FORMAT_VERSION,
                "file": path.name,
                "bytes": size,
                "blake2b": digest,
                "step": checkpoint.step,
                "epoch": checkpoint.epoch,
                "phase_index": checkpoint.phase_index,
                "created": checkpoint.created,
                "fingerprint": _plain(checkpoint.fingerprint, "fingerprint"),
            }
            text = json.dumps(record, indent=1, default=str).encode()
            self._write(manifest, lambda f: f.write(text))
        except OSError as error:
            raise CheckpointError(
                f"could not write checkpoint {path} ({error.strerror or error}); check the "
                f"free space and permissions of {self.directory}"
            ) from error
        stat = path.stat()
        self._verified[path] = (stat.st_size, stat.st_mtime_ns)
        self.prune()
        return path

    def _write(self, path: Path, fill: Any) -> tuple[str, int]:
        """Write through ``fill(file)`` to a temporary file beside ``path``, fsync it, rename
        it onto ``path``, fsync the directory. Returns the blake2b hex digest and size."""
        temp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as raw:
                writer = _HashingWriter(raw, float(os.environ.get(WRITE_DELAY_ENV, "0") or 0))
                fill(writer)
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)
        return writer.hash.hexdigest(), writer.size

    # -- reading -------------------------------------------------------------------
    def _read_verified(self, path: Path) -> bytes:
        """The bytes of ``path`` if its manifest exists and the checksum matches; else
        ``CheckpointError`` naming the file and what is wrong."""
        manifest = self.manifest_path(path)
        try:
            record = json.loads(manifest.read_text())
            expected = str(record["blake2b"])
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {path} has no manifest ({manifest.name}): its write did not "
                "finish (the process stopped mid-write); resume from an older checkpoint"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"checkpoint {path}: its manifest {manifest.name} is unreadable ({error}); "
                "the checkpoint cannot be verified, resume from an older one"
            ) from error
        try:
            data = path.read_bytes()
        except OSError as error:
            raise CheckpointError(f"checkpoint {path} cannot be read: {error}") from error
        if hashlib.blake2b(data).hexdigest() != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: its content ({len(data)} bytes) does not match "
                f"the checksum in {manifest.name} (truncated or overwritten); resume from an "
                "older checkpoint"
            )
        return data

    def load(self, path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Checkpoint:
        """The checkpoint at ``path``, verified against its manifest first."""
        path = Path(path)
        data = self._read_verified(path)
        return _deserialize(data, path, map_location)

    def checkpoints(self, *, warn: bool = False) -> list[Path]:
        """Valid checkpoints, newest first (``warn``: name each invalid one skipped)."""
        valid = []
        for _, path in self._candidates():
            if self._is_valid(path, warn=warn):
                valid.append(path)
        return valid

    def _is_valid(self, path: Path, *, warn: bool) -> bool:
        try:
            stat = path.stat()
            cached = self._verified.get(path) == (stat.st_size, stat.st_mtime_ns)
            if not (cached and self.manifest_path(path).exists()):
                self._read_verified(path)
        except (CheckpointError, OSError) as error:
            self._verified.pop(path, None)
            if warn:
                warnings.warn(f"skipping {error}", RuntimeWarning, stacklevel=3)
            return False
        self._verified[path] = (stat.st_size, stat.st_mtime_ns)
        return True

    def latest(self) -> Path | None:
        """The newest valid checkpoint, or None; corrupt or partial newer ones are
        skipped with a warning naming each."""
        for _, path in self._candidates():
            if self._is_valid(path, warn=True):
                return path
        return None

    def load_latest(
        self, expect: Mapping[str, Any] | None = None, *, map_location: Any = "cpu"
    ) -> Checkpoint | None:
        """The newest valid checkpoint (None if there is none). With ``expect`` (this
        fit's :func:`fingerprint`), a checkpoint of another model, dataset or config is
        refused with ``IncompatibleCheckpointError`` listing every difference."""
        for _, path in self._candidates():
            try:
                data = self._read_verified(path)
            except CheckpointError as error:
                warnings.warn(f"skipping {error}", RuntimeWarning, stacklevel=2)
                continue
            checkpoint = _deserialize(data, path, map_location)
            if expect is not None:
                differences = compare_fingerprints(checkpoint.fingerprint, expect)
                if differences:
                    raise IncompatibleCheckpointError(self._incompatible(path, differences))
            return checkpoint
        return None

    def _incompatible(self, path: Path, differences: list[str]) -> str:
        shown = differences[:MAX_LISTED_DIFFERENCES]
        lines = [
            f"the checkpoint {path} belongs to another run: {len(differences)} difference(s)",
            *(f"  - {d}" for d in shown),
        ]
        if len(differences) > len(shown):
            lines.append(f"  ... and {len(differences) - len(shown)} more")
        lines.append(
            "To train this model on this data, start a fresh run with another checkpoint_dir, "
            f"or pass resume=False to start over (the checkpoints in {self.directory} are then "
            "replaced); to resume the old run, use the model, data and config it was saved with."
        )
        return "\n".join(lines)

    # -- housekeeping --------------------------------------------------------------
    def prune(self) -> list[Path]:
        """Keep the ``keep`` newest valid checkpoints; delete older checkpoints (valid or
        not) and the temporary files of writes that never finished. Returns what went."""
        candidates = self._candidates()
        kept: list[int] = []
        kept_paths: list[Path] = []
        rest: list[tuple[int, Path]] = []  # invalid ones, and all past the kept ones
        for step, path in candidates:
            if len(kept) < self.keep and self._is_valid(path, warn=False):
                kept.append(step)
                kept_paths.append(path)
            else:
                rest.append((step, path))
        if not kept:
            return []
        # Invalid files newer than the oldest kept stay: latest() names them in its warning.
        removed = [path for step, path in rest if step < kept[-1]]
        for path in removed:
            self.manifest_path(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            self._verified.pop(path, None)
        newest = max(path.stat().st_mtime for path in kept_paths)
        for entry in self.directory.glob(f".ckpt-*{TEMP_SUFFIX}"):
            try:
                if entry.stat().st_mtime <= newest:  # older than the last finished save
                    entry.unlink()
                    removed.append(entry)
            except FileNotFoundError:
                pass
        return removed

    def clear(self) -> None:
        """Delete every checkpoint of this directory (a fresh run with resume=False)."""
        for _, path in self._candidates():
            self.manifest_path(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        for entry in self.directory.glob(f".ckpt-*{TEMP_SUFFIX}"):
            entry.unlink(missing_ok=True)
        self._verified.clear()


def _deserialize(data: bytes, path: Path, map_location: Any) -> Checkpoint:
    # weights_only=True: a checkpoint holds tensors and plain containers only
    # (Checkpoint.to_dict refuses anything else), so loading never unpickles code.
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {path} matches its checksum but cannot be loaded ({error}); it was "
            "not written by dataflow's CheckpointStore, or by an incompatible version"
        ) from error
    return Checkpoint.from_dict(state, source=f"checkpoint {path}")


class _HashingWriter:
    """A write-only file that hashes what passes through (the manifest's checksum,
    without reading the file back). With ``delay`` (tests only) it writes one MiB at a
    time and sleeps after each, so another process can kill it mid-write."""

    def __init__(self, raw: Any, delay: float = 0.0) -> None:
        self.raw = raw
        self.hash = hashlib.blake2b()
        self.size = 0
        self.delay = delay

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        step = _MIB if self.delay > 0 else len(view) or 1
        for start in range(0, len(view), step):
            self.raw.write(view[start : start + step])
            if self.delay > 0:
                self.raw.flush()
                time.sleep(self.delay)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.raw.flush()


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable: fsync the directory entry (POSIX; a no-op where a directory
    cannot be opened, as on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
