"""One error hierarchy for the engine (layer 0: every layer raises these).

Every error the engine raises on purpose is a ``DataflowError``. Each subclass
also inherits the matching built-in, so ``except ValueError`` in user code keeps
working. Messages name the argument, stage or file at fault and say how to fix it.
"""

from __future__ import annotations


class DataflowError(Exception):
    """Base class of every error raised on purpose by dataflow."""


class ConfigError(DataflowError, ValueError):
    """A configuration value is invalid (names the field and the fix)."""


class BatchSizeError(ConfigError):
    """A batch size is non-positive or larger than the dataset."""


class GraphError(DataflowError, ValueError):
    """The stage graph is malformed: cycle, dangling input, missing stage."""


class ModelError(DataflowError, TypeError):
    """A user factory (model, optimizer) returned the wrong kind of object."""


class LossError(DataflowError, ValueError):
    """The loss function returned something that is not a finite scalar tensor."""


class NonFiniteError(LossError, FloatingPointError):
    """A NaN or inf loss or gradient, caught before the update was applied."""


class DataError(DataflowError, ValueError):
    """Input arrays are inconsistent (sample counts, dtypes, dimensions)."""


class ChunkMissingError(DataflowError, KeyError):
    """A chunk is absent from the store; zarr would silently return fill values."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class ChunkReadError(DataflowError, OSError):
    """A chunk exists in the store but could not be read or decoded (corrupt, truncated)."""


class StoreAccessError(DataflowError, OSError):
    """A store refused a read or could not be reached: no credentials in this process,
    credentials the store refuses, or no route to its endpoint (not a corrupt chunk)."""


class StoreUnavailableError(StoreAccessError):
    """A store kept failing transiently (throttling, server errors, dropped connections)
    for longer than a source's ``retry_s``: the store, not the data, is at fault."""


class ReplicaError(DataflowError, RuntimeError):
    """A replica failed on its worker, or the replicas' weights diverged."""


class CollectiveError(DataflowError, RuntimeError):
    """Forming or using the process group across replicas failed."""


class CheckpointError(DataflowError, OSError):
    """A checkpoint directory cannot be written, or a checkpoint file is corrupt or partial."""


class IncompatibleCheckpointError(DataflowError, ValueError):
    """A checkpoint belongs to another model, dataset or configuration than this fit."""


class CallbackError(DataflowError, RuntimeError):
    """A callback the user gave the fit (``fit(on_epoch=...)``) raised; the fit stopped.
    Its error is the ``__cause__``."""


class WorkerLostError(ReplicaError):
    """Workers died and too few remain to go on (``min_workers``)."""


class FitStopped(DataflowError, RuntimeError):
    """The driver got a stop signal (``TrainerConfig.stop_signals``: SIGTERM, SIGUSR1, a
    batch system's notice before it ends the job): the fit saved what it had committed
    and stopped. ``signal``: its name; ``step``: the first step not kept; ``checkpoint``:
    the checkpoint to resume from (None: none was written, or no ``checkpoint_dir``)."""

    def __init__(
        self, message: str, *, signal: str = "", step: int = 0, checkpoint: str | None = None
    ) -> None:
        super().__init__(message)
        self.signal, self.step, self.checkpoint = signal, step, checkpoint


def as_replica_error(exc: BaseException, rank: int, worker: str) -> BaseException:
    """dataflow's own errors as they are; anything else as a ReplicaError naming where."""
    if isinstance(exc, Exception) and type(exc).__module__.startswith("dataflow"):
        return exc
    notes = getattr(exc, "__notes__", None) or []  # where: "in stage 'Transform' ..., step 4"
    where = f" ({'; '.join(map(str, notes))})" if notes else ""
    error = ReplicaError(
        f"replica {rank} on worker {worker} failed{where}: {type(exc).__name__}: {exc}"
    )
    error.__cause__ = exc
    return error
