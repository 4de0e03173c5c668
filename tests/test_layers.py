"""The layers (docs/architecture.md, "Layers"): imports only point down.

Layer 0 ``dataflow/core`` imports nothing of dataflow outside itself; io and ops import
only core (ops not io); stages import core, io and ops; none of them imports the
engine, not even inside a function. Checked on the source with ``ast``, so this needs
nothing outside the repository.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ENGINE = (
    "dataflow.trainer",
    "dataflow.driver",
    "dataflow.runtime",
    "dataflow.schedule",
    "dataflow.checkpoint",
    "dataflow.history.report",
    "dataflow.pipeline",
    "dataflow.tools.cli",
    "dataflow.planning.plan",
    "dataflow.schedule.balance",
    "dataflow.history",
)

# folder -> the dataflow modules it may import (prefixes); anything else of dataflow is a break
ALLOWED = {
    "dataflow/core": ("dataflow.core",),
    "io": ("dataflow.core", "dataflow.io"),
    "ops": ("dataflow.core", "dataflow.ops"),
    "stages": ("dataflow.core", "dataflow.io", "dataflow.ops", "dataflow.stages"),
}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _parse(path: Path) -> ast.Module:
    """``ast.parse``, again when CPython 3.11.7's AST converter trips on its recursion
    counter, which all threads share (python/cpython#106905): a Dask thread formatting
    a logged traceback (3.11's carets parse the line) at the same moment raises
    ``SystemError: AST constructor recursion depth mismatch`` here."""
    for attempt in range(5):
        try:
            return ast.parse(path.read_text(), filename=str(path))
        except SystemError as error:
            if "recursion depth mismatch" not in str(error) or attempt == 4:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def _dataflow_imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import of a dataflow module in ``path``, at any depth."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "dataflow":  # ``from dataflow import trainer``: a module
                found += [(node.lineno, f"dataflow.{alias.name}") for alias in node.names]
    return [(line, module) for line, module in found if _within(module, ("dataflow",))]


def _breaks(folder: str) -> list[str]:
    allowed = ALLOWED[folder]
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, module in _dataflow_imports(path):
            if not _within(module, allowed) or _within(module, ENGINE):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_layer_imports_only_point_down(folder):
    assert (ROOT / folder).is_dir(), f"{folder}/ is missing"
    assert _breaks(folder) == []


def test_no_relative_imports_hide_a_layer():
    """Relative imports would slip past the check above; the layers use none."""
    relative = []
    for folder in ALLOWED:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(_parse(path)):
                if isinstance(node, ast.ImportFrom) and node.level:
                    relative.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert relative == []


BARE_IMPORT = re.compile(r"^\s*(from|import)\s+(stages|ops|io)\b", re.MULTILINE)


def _bare_folder_imports(path: Path) -> list[str]:
    """Imports of the code folders by their bare names (``from stages.update import``,
    ``import ops.flat``; ``io`` only with a submodule of ours: plain ``io`` is Python's)."""
    if not BARE_IMPORT.search(path.read_text()):  # (most files: no need to parse them)
        return []
    ours = {p.stem for p in (ROOT / "io").glob("*.py")}
    bad = []
    for node in ast.walk(_parse(path)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            head, _, rest = name.partition(".")
            if head in ("stages", "ops") or (head == "io" and rest.split(".")[0] in ours):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return bad


def test_no_code_imports_a_folder_by_its_bare_name():
    """setup.cfg maps io/, ops/ and stages/ into ``dataflow``; imported by their bare
    names (a test run from the checkout can) they would be second copies of the
    modules, with their own classes and state."""
    bad = []
    for folder in ("dataflow", "io", "ops", "stages", "tests", "examples", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad += _bare_folder_imports(path)
    assert bad == []


def test_the_checker_sees_a_break(tmp_path):
    """The check itself: an engine import inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from dataflow.schedule import lr_at\n    from dataflow import trainer\n"
    )
    assert _dataflow_imports(module) == [
        (2, "dataflow.schedule"),
        (3, "dataflow"),
        (3, "dataflow.trainer"),
    ]


def test_core_stays_light():
    """Importing the bottom layer loads neither the cluster machinery nor torch, nor any
    upper layer: pure modules (the planner, the driver's state machine) import from it."""
    # dataflow/__init__ imports the whole engine (Trainer); a stub parent package loads
    # dataflow.core alone, as a pure module importing only the bottom layer sees it.
    code = f"""
import sys, types
pkg = types.ModuleType("dataflow")
pkg.__path__ = [{str(ROOT / "dataflow")!r}]
sys.modules["dataflow"] = pkg
import dataflow.core
from dataflow.core import Batch, ConfigError, PhaseSpec, Schedule, StepSpec, WindowResult
heavy = ("distributed", "dask", "torch", "numba", "zarr")
loaded = sorted(
    m for m in sys.modules
    if m.split(".")[0] in heavy
    or (m.startswith("dataflow.") and not m.startswith("dataflow.core"))
)
print(loaded)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_rng_is_exported_lazily():
    from dataflow import core
    from dataflow.core.rng import capture_rng

    assert core.capture_rng is capture_rng
    with pytest.raises(AttributeError):
        core.no_such_name  # noqa: B018


def test_stage_kinds_classify_waiting_stages():
    """One classification: the runtime's throttle and the report ask ``Stage.kind``."""
    from dataflow.core import kinds
    from dataflow.stages import Evaluate, Forward, Load, Stage

    assert Stage.kind == kinds.COMPUTE and Forward.kind == kinds.COMPUTE
    assert (Load.kind, Evaluate.kind) == (kinds.LOAD, kinds.EVALUATE)
    assert set(kinds.TIME_TERMS) == set(kinds.KINDS)

    class Waiting(Stage):
        kind = kinds.ALLREDUCE

    assert Waiting().waits_on_peers_or_data
    assert not Stage().waits_on_peers_or_data


def test_core_protocols_are_checked_where_objects_come_in():
    import numpy as np

    from dataflow.core import protocols
    from dataflow.errors import ConfigError, GraphError
    from dataflow.graph import Graph
    from dataflow.io import ArraySource
    from dataflow.ops import REGISTRY
    from dataflow.ops.registry import register
    from dataflow.stages import Load, Stage

    source = ArraySource(np.zeros((4, 2), dtype=np.float32))
    assert isinstance(source, protocols.Source)
    with pytest.raises(ConfigError, match="has no 'read'"):
        Load(type("NoRead", (), {"num_samples": 3})())
    assert all(isinstance(op, protocols.Kernel) for op in REGISTRY.values())
    with pytest.raises(ConfigError, match="cannot register str"):
        register("not an op")
    assert isinstance(Stage(), protocols.Stage)
    with pytest.raises(GraphError, match="expected a dataflow stage"):
        Graph().add(object())
