"""Which of a window round's failures caused the others, pure.

When one replica fails, its peers' collectives fail after it ("connection closed by
peer"), each a :class:`~dataflow.core.errors.CollectiveError`: only an echo. The fit
reports the first real failure: the earliest (window, rank) whose error is not an
echo, else the earliest of the echoes.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataflow.core.errors import CollectiveError


def root_cause(failures: Sequence[tuple[tuple[int, int], BaseException | None]]) -> int | None:
    """The index in ``failures`` (``((window, rank), error)``, an error None where it
    could not be read) of the one to report; None when no error could be read."""
    readable = sorted((key, i) for i, (key, error) in enumerate(failures) if error is not None)
    real = [(key, i) for key, i in readable if not isinstance(failures[i][1], CollectiveError)]
    chosen = (real or readable)[:1]
    return chosen[0][1] if chosen else None
