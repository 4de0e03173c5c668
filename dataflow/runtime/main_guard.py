"""Is ``fit()`` being called from a script's top level, outside ``if __name__ ==
"__main__":``? The embedded LocalCluster's worker processes are started with spawn:
each imports the user's script again, so such a script would start a cluster inside
every worker, and the nanny gives up only after its start timeout (13-23 s). Seen from
the driver's stack before anything is started, the same mistake is named at once."""

from __future__ import annotations

import ast
import sys
from types import FrameType

SPAWNING_METHODS = ("spawn", "forkserver")  # the start methods that import __main__ again


def line_is_guarded(source: str, lineno: int) -> bool:
    """Whether line ``lineno`` of module ``source`` lies in an ``if`` statement whose test
    reads ``__name__`` (``if __name__ == "__main__":`` in any spelling, branches
    included), or in a function or class body, which importing the module does not run.
    Unparsable source counts as guarded: the check must never refuse a script it does
    not understand."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return True
    for node in ast.walk(tree):
        guard = isinstance(node, ast.If) and _reads_name(node.test)
        body = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        if (guard or body) and node.lineno <= lineno <= (node.end_lineno or node.lineno):
            return True
    return False


def _reads_name(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(test))


def unguarded_script_line(frame: FrameType | None) -> tuple[str, int] | None:
    """``(script path, line)`` of the call in ``__main__``'s top-level code on the stack
    above ``frame`` when that line is not guarded; None otherwise (an interactive session,
    ``python -c``, a notebook, a guarded call, or no script frame on the stack)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            try:
                with open(code.co_filename, encoding="utf-8") as f:
                    source = f.read()
            except OSError:
                return None
            if line_is_guarded(source, frame.f_lineno):
                return None
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None
