"""The checkpoint store: checkpoints of one run in a directory, written so a crash never
leaves one that looks valid.

:class:`CheckpointStore` writes each :class:`~dataflow.checkpoint.Checkpoint` to a
temporary file, fsyncs it, renames it into place, then writes a JSON manifest with the
file's blake2b checksum the same way; a checkpoint counts only when its manifest exists
and the checksum matches, so a write cut short at any point leaves the previous
checkpoint as the newest valid one. Loading verifies the checksum, then reads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dataflow.checkpoint.fingerprint import compare_fingerprints
from dataflow.checkpoint.format import FORMAT_VERSION, Checkpoint, plain_state
from dataflow.core.errors import CheckpointError, ConfigError, IncompatibleCheckpointError

STEPS_FILE = "history-steps.jsonl"  # the fit's history steps, one JSON line each
STEPS_COUNT = "steps_in_file"  # Checkpoint.history key (format 3): the steps it covers
BEST_FILE, BEST_MANIFEST = "best.pt", "best.json"  # fit(keep_best=...): dataflow.checkpoint.best
NAME = re.compile(r"^ckpt-(\d{10})\.pt$")
TEMP_SUFFIX = ".tmp"
MAX_LISTED_DIFFERENCES = 25  # in an error message; compare_fingerprints returns them all
# Test hook: seconds to sleep after each MiB written, so a test can kill a writer
# mid-write from another process. Never set it outside tests.
WRITE_DELAY_ENV = "DATAFLOW_CHECKPOINT_WRITE_DELAY_S"
_MIB = 2**20


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
        self._step_lines: int | None = None  # lines in the steps file (None: not read yet)
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
            digest, size = self.write_atomic(path, lambda f: torch.save(state, f))
            record = {
                "format_version": FORMAT_VERSION,
                "file": path.name,
                "bytes": size,
                "blake2b": digest,
                "step": checkpoint.step,
                "epoch": checkpoint.epoch,
                "phase_index": checkpoint.phase_index,
                "created": checkpoint.created,
                "fingerprint": plain_state(state["fingerprint"], "fingerprint", json=True),
            }
            text = json.dumps(record, indent=1).encode()
            self.write_atomic(manifest, lambda f: f.write(text))
        except OSError as error:
            raise CheckpointError(
                f"could not write checkpoint {path} ({error.strerror or error}); check the "
                f"free space and permissions of {self.directory}"
            ) from error
        stat = path.stat()
        self._verified[path] = (stat.st_size, stat.st_mtime_ns)
        self.prune()
        return path

    def write_atomic(self, path: Path, fill: Any) -> tuple[str, int]:
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
    def load(self, path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Checkpoint:
        """The checkpoint at ``path``, verified against its manifest first."""
        path = Path(path)
        data = read_verified(path)
        return self._with_steps(_deserialize(data, path, map_location))

    # -- the history's steps: one line each, appended once, not saved with every checkpoint
    @property
    def steps_path(self) -> Path:
        return self.directory / STEPS_FILE

    def append_steps(self, first: int, steps: list[dict[str, Any]]) -> int:
        """Make the steps file hold exactly ``first`` steps (a fit that went back to an
        older checkpoint drops the later ones), then append ``steps`` (plain, JSON);
        returns how many it holds. A checkpoint records that count, and loading it reads
        that many back (:meth:`load`), so each step is written once in a fit."""
        held = self._read_steps(first) if self._step_lines != first else None
        if held is not None and len(held) < first:
            raise CheckpointError(
                f"{self.steps_path} holds {len(held)} steps, the fit has {first}; it was "
                "deleted or truncated while the fit ran"
            )
        if held is not None:  # more lines than the fit has: rewrite the first ``first``
            self.steps_path.write_text("".join(json.dumps(step) + "\n" for step in held))
        with open(self.steps_path, "a") as out:
            out.writelines(json.dumps(step) + "\n" for step in steps)
            out.flush()
            os.fsync(out.fileno())
        self._step_lines = first + len(steps)
        return self._step_lines

    def _read_steps(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` steps of the steps file (fewer if it holds fewer)."""
        steps: list[dict[str, Any]] = []
        if count and self.steps_path.exists():
            with open(self.steps_path) as lines:
                for line in lines:
                    if len(steps) == count:
                        break
                    try:
                        steps.append(json.loads(line))
                    except ValueError:  # a line cut short by a crash: the end of the file
                        break
        return steps

    def _with_steps(self, checkpoint: Checkpoint) -> Checkpoint:
        """``history["steps"]`` read back from the steps file (format 3)."""
        history = checkpoint.history
        count = history.get(STEPS_COUNT)
        if count is None:  # formats 1 and 2 hold their steps inline
            return checkpoint
        steps = self._read_steps(int(count))
        if len(steps) < count:
            warnings.warn(
                f"{self.steps_path} holds {len(steps)} of the {count} history steps of "
                f"checkpoint step {checkpoint.step}; the resumed history lacks the rest "
                "(training itself resumes exactly)",
                RuntimeWarning,
                stacklevel=3,
            )
        rest = {k: v for k, v in history.items() if k != STEPS_COUNT}
        return dataclasses.replace(checkpoint, history={**rest, "steps": steps})

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
                read_verified(path)
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
                data = read_verified(path)
            except CheckpointError as error:
                warnings.warn(f"skipping {error}", RuntimeWarning, stacklevel=2)
                continue
            checkpoint = self._with_steps(_deserialize(data, path, map_location))
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
        """Delete every checkpoint of this directory, the steps file and the best weights
        (a fresh run with resume=False)."""
        for _, path in self._candidates():
            self.manifest_path(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        for entry in self.directory.glob(f".ckpt-*{TEMP_SUFFIX}"):
            entry.unlink(missing_ok=True)
        self.steps_path.unlink(missing_ok=True)
        for name in (BEST_FILE, BEST_MANIFEST):  # the best epoch's weights (keep_best)
            (self.directory / name).unlink(missing_ok=True)
        self._step_lines = 0
        self._verified.clear()


def read_verified(path: Path) -> bytes:
    """The bytes of ``path`` if its manifest exists and the checksum matches; else
    ``CheckpointError`` naming the file and what is wrong."""
    manifest = CheckpointStore.manifest_path(path)
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
