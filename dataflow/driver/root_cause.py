"""Which of a window round's failures caused the others, pure.

When one replica fails, its peers' collectives fail after it ("connection closed by
peer"), each a :class:`~dataflow.core.errors.CollectiveError`, and their parameter-store
calls fail with the failed replica's reason (a ``ShardError``, "replica 0 failed in
window 2: ..."): only echoes. The fit reports the first real failure: the earliest
(window, rank) whose error is not an echo, else the earliest of the echoes.
"""

from __future__ import annotations

from collections.abc import Sequence

# Errors that report another replica's failure. Named, not imported: pure.
_ECHOES = {"CollectiveError", "ShardError"}


def is_echo(error: BaseException) -> bool:
    """Whether ``error`` only reports a peer's failure (its collective or the store)."""
    return any(kind.__name__ in _ECHOES for kind in type(error).__mro__)


def root_cause(failures: Sequence[tuple[tuple[int, int], BaseException | None]]) -> int | None:
    """The index in ``failures`` (``((window, rank), error)``, an error None where it
    could not be read) of the one to report; None when no error could be read."""
    readable = sorted((key, i) for i, (key, error) in enumerate(failures) if error is not None)
    real = [(key, i) for key, i in readable if not is_echo(failures[i][1])]
    chosen = (real or readable)[:1]
    return chosen[0][1] if chosen else None


# Errors a replica raises when a peer or the cluster went away under it: a collective's
# or a store's connection closed or timed out. Any of them may be the echo of a worker
# the scheduler has not yet reported lost. Named, not imported: pure.
_MAY_ECHO_A_LOSS = {
    "CollectiveError",
    "RuntimeError",  # gloo's "connection closed by peer", "timed out waiting"
    "DistStoreError",
    "DistNetworkError",
    "OSError",
    "ConnectionError",
    "ConnectionResetError",
    "BrokenPipeError",
    "TimeoutError",
    "CommClosedError",
    "CancelledError",
}


def may_echo_a_loss(error: BaseException | None) -> bool:
    """Whether ``error`` may be a peer's death seen from a survivor, so that the driver
    should give the scheduler a moment to report the loss before calling it a failure.
    None (a cancelled task) may; an error of the replica's own (bad data, a model's
    mistake, a non-finite step, out of memory) does not, and is reported at once."""
    if error is None:
        return True
    return any(kind.__name__ in _MAY_ECHO_A_LOSS for kind in type(error).__mro__[:-2])
