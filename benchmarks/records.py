"""What a benchmark run leaves behind: its record appended to ``results/<name>.json``
(with the machine it ran on) and the text tables it prints."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except Exception:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    import dask
    import distributed

    import dataflow

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "dataflow": dataflow.__version__,
        "git_commit": _git_commit(),
    }


def to_jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def save_run(name: str, run: dict[str, Any], out: str | Path | None, *, overwrite: bool) -> Path:
    """Append ``run`` (with machine info) to ``results/<name>.json`` (a list of runs)."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs: list[Any] = []
    if path.exists() and not overwrite:
        try:
            previous = json.loads(path.read_text())
            if previous.get("benchmark") == name:
                runs = previous.get("runs", [])
        except (ValueError, AttributeError):
            runs = []
    runs.append(to_jsonable({"machine": machine_info(), **run}))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"benchmark": name, "runs": runs}, indent=1))
    tmp.replace(path)
    return path


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
