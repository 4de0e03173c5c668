"""What the code and the docs cite is in the repository: every module path
(``dataflow.x.y``, ``dataflow.x.Name``), every repository file (``benchmarks/x.py``,
``docs/x.md``) and every document (``README.md``, ``design.md``). A module renamed or
moved, a benchmark that was never written or a document outside the repository then
fails here, not in the reader's hands."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

from test_layers import _parse  # ast.parse, again on CPython 3.11.7's AST-counter race

ROOT = Path(__file__).resolve().parents[1]
CODE = ("dataflow", "tests", "benchmarks", "io", "ops", "stages", "examples")
REPO_FOLDERS = ("dataflow", "benchmarks", "tests", "examples", "io", "ops", "stages", "docs")
OUTPUTS = {"report.md"}  # files a fit or a command writes, not documents of the repository


def _texts() -> Iterator[Path]:
    """The code and the docs (not this file, whose examples are made up)."""
    for folder in CODE:
        yield from (p for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__))
    yield ROOT / "README.md"
    yield ROOT / "benchmarks" / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """The names a module binds at its top level, and the identifiers it names as strings
    (a lazy ``__getattr__`` map's keys)."""
    tree = _parse(path)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    strings = (n.value for n in ast.walk(tree) if isinstance(n, ast.Constant))
    return frozenset(names | {s for s in strings if isinstance(s, str) and s.isidentifier()})


def _resolves(dotted: str) -> bool:
    """``dataflow.a.b[.Name...]``: a package or module, then (optionally) a name it binds."""
    path, parts = ROOT, dotted.split(".")
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            rest = parts[i + 1 :]
            return not rest or rest[0] in _defined(path / f"{part}.py")
        else:
            init = path / "__init__.py"
            return i > 0 and init.is_file() and part in _defined(init)
    return True


def test_every_dataflow_module_path_the_code_and_docs_name_exists():
    named = {
        (str(path.relative_to(ROOT)), m.group(1))
        for path in _texts()
        for m in re.finditer(r"(?<![\w./-])(dataflow(?:\.[A-Za-z_]\w*)+)", path.read_text())
    }
    assert len(named) > 50, len(named)
    missing = sorted((where, name) for where, name in named if not _resolves(name))
    assert not missing, f"these name no module or name of the package (renamed?): {missing}"


def test_every_repository_file_the_code_and_docs_name_exists():
    folders = "|".join(REPO_FOLDERS)
    pattern = rf"(?<![\w./-])((?:{folders})/(?:[\w-]+/)*[\w-]+\.(?:py|md|sh))\b"
    missing = sorted(
        (str(path.relative_to(ROOT)), name)
        for path in _texts()
        for name in re.findall(pattern, path.read_text())
        if not (ROOT / name).exists() and not re.search(r"/[A-Z_]+\.py$", name)  # NAME.py
    )
    assert not missing, f"these files are not in the repository: {missing}"


def test_every_document_the_code_and_docs_cite_is_in_the_repository():
    """A bare ``x.md`` is a document beside the citing file, at the root or in docs/."""
    missing = []
    for path in _texts():
        for name in re.findall(r"(?<![\w./-])([\w-]+\.md)\b", path.read_text()):
            bases = (ROOT, ROOT / "docs", path.parent)
            if name not in OUTPUTS and not any((base / name).is_file() for base in bases):
                missing.append((str(path.relative_to(ROOT)), name))
    assert not missing, f"these documents are not in the repository: {sorted(missing)}"


def test_every_dfl_name_the_docs_use_resolves_after_a_bare_import():
    """``dfl.checkpoint.load_best(...)`` in the README: a name the package only has once
    another module imported it (a fit imports ``dataflow.checkpoint``) works in the fit's
    script and fails in a later one. Every ``dfl.<name>`` of the docs is one the package
    has right after ``import dataflow as dfl``, or one it imports on first use (its
    ``_LAZY`` and ``_SUBMODULES``), checked in a fresh interpreter before any is used."""
    import subprocess
    import sys

    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {n for doc in docs for n in re.findall(r"\bdfl\.([A-Za-z_]\w*)", doc.read_text())}
    names = sorted(found)
    assert "checkpoint" in names and "Pipeline" in names
    check = (
        "import dataflow as dfl\n"
        "known = set(vars(dfl)) | set(dfl._LAZY) | set(dfl._SUBMODULES)\n"
        f"print([n for n in {names!r} if n not in known])"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"names the docs use that dataflow lacks: {done.stdout}"
