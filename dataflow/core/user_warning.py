"""Warnings that point at the user's own line (the ``fit`` call), not at the engine's.

``warnings.warn``'s ``stacklevel`` counts frames from the caller; a warning raised deep
in the driver (the loop, the executor) would otherwise name an engine file the user
never wrote. Python 3.12's ``skip_file_prefixes`` does this; the engine supports 3.10.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

__all__ = ["warn_user"]

# the package's folders (setup.cfg maps dataflow, stages, io and ops into ``dataflow``)
_ENGINE = tuple(
    str(Path(__file__).resolve().parents[2] / name) + os.sep
    for name in ("dataflow", "stages", "io", "ops")
)


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside the engine (and outside
    the standard library's ``threading``/``contextlib`` plumbing around it); the
    caller's own frame when there is none (a fit driven from an engine thread)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = str(Path(frame.f_code.co_filename).resolve())
        if not name.startswith(_ENGINE) and not _plumbing(name):
            warnings.warn(message, category, stacklevel=level + 1)
            return
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=2)


def _plumbing(filename: str) -> bool:
    return Path(filename).name in ("contextlib.py", "threading.py", "functools.py")
