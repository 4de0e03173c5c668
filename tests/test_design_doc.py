"""docs/design.md names a test for each invariant: every test and file it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layers import _parse  # ast.parse, again on CPython 3.11.7's AST-counter race

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def _test_functions(path: Path) -> set[str]:
    tree = _parse(path)
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_test_the_design_names_exists():
    text = DESIGN.read_text()
    named = re.findall(r"`(tests/test_\w+\.py)(?:::(\w+))?`", text)
    assert len(named) >= 10, named
    for file, function in named:
        path = ROOT / file
        assert path.is_file(), f"docs/design.md names {file}, which does not exist"
        if function:
            assert function in _test_functions(path), f"{file} has no {function}"
    # continuation cells ("`::name`") name a function of the file before them
    for row in text.splitlines():
        files = re.findall(r"`(tests/test_\w+\.py)", row)
        for function in re.findall(r"`::(\w+)`", row):
            assert files and function in _test_functions(ROOT / files[-1]), (row, function)
