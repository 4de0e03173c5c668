"""Name the damaged metadata file of a zarr store that failed to open.

Zarr reports a corrupt ``zarr.json`` or ``.zarray`` as whatever its parser raised;
after opening fails, this looks at the metadata files themselves, so the error can
say which file is broken and how.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import zarr

# The metadata files of a zarr node, format 3 then format 2 (.zmetadata: consolidated).
METADATA_FILES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")


def _metadata_problem(name: str, raw: bytes) -> str | None:
    """What is wrong with one metadata file's content, or None if it looks sound."""
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(document, dict):
        return f"a JSON {type(document).__name__}, not an object"
    required = {
        "zarr.json": ("zarr_format", "node_type"),
        ".zarray": ("zarr_format", "shape", "chunks", "dtype"),
        ".zgroup": ("zarr_format",),
    }.get(name, ())
    missing = [key for key in required if key not in document]
    if missing:
        return f"the key(s) {missing} that every {name} has are missing"
    return None


def _store_files(store: Any, storage_options: Any) -> tuple[Any, str] | None:
    """(fsspec filesystem, root path) of a store given as a path or URL, or of an opened
    zarr node on a local store; None where its files cannot be reached that way."""
    import fsspec

    if isinstance(store, (zarr.Array, zarr.Group)):
        root = getattr(store.store, "root", None)  # a LocalStore's folder
        if root is None:
            return None
        path = store.store_path.path
        return fsspec.filesystem("file"), str(Path(root, path) if path else root)
    if isinstance(store, (str, Path)):
        return fsspec.core.url_to_fs(str(store), **(storage_options or {}))
    return None


def corrupt_metadata(store: Any, members: list[str], storage_options: Any) -> str | None:
    """The first damaged metadata file of the store's root or of ``members``, as
    'path is corrupt: problem'; looked for only after opening failed. None if none is found."""
    try:
        located = _store_files(store, storage_options)
        if located is None:
            return None
        fs, root = located
        for member in ["", *members]:
            folder = "/".join(p for p in (root.rstrip("/"), member) if p)
            for name in METADATA_FILES:
                path = f"{folder}/{name}"
                if fs.isfile(path):
                    problem = _metadata_problem(name, fs.cat_file(path))
                    if problem is not None:
                        return f"{path} is corrupt: {problem}"
    except Exception:  # the store cannot be listed: the original error is reported instead
        return None
    return None
