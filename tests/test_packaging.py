"""What `pip install .` and `pip wheel .` package: every module and data file on disk.

setuptools is asked, without building anything, what its build_py step would copy into
a wheel (setup.py derives the package list from setup.cfg's `package_dir`); that must
cover every module under the package folders. A package left out is a wheel whose
`import dataflow...` fails while the editable checkout works. .ci/run also builds the
wheel, installs it into a fresh environment and imports every module from there.
"""

import shutil
import subprocess
from distutils.core import run_setup  # setuptools' distutils, the one its setup() runs in
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The four code folders, one import package (a bare `io` would shadow the standard library).
FOLDERS = {
    "dataflow": "dataflow",
    "dataflow.stages": "stages",
    "dataflow.ops": "ops",
    "dataflow.io": "io",
}


@pytest.fixture
def build_py(monkeypatch):
    """setuptools' build_py command configured as a wheel build configures it."""
    monkeypatch.chdir(ROOT)  # setup.cfg and the package folders are read from the cwd
    dist = run_setup(str(ROOT / "setup.py"), stop_after="config")
    cmd = dist.get_command_obj("build_py")
    cmd.ensure_finalized()
    return cmd


def disk_packages() -> dict[str, Path]:
    """Import name -> folder of every package on disk (a folder with an `__init__.py` whose
    parents down from its code folder are packages too: setuptools' rule)."""
    found = {}
    for name, folder in FOLDERS.items():
        stack = [(name, ROOT / folder)]
        while stack:
            package, path = stack.pop()
            if (path / "__init__.py").is_file():
                found[package] = path
                stack += [(f"{package}.{sub.name}", sub) for sub in path.iterdir() if sub.is_dir()]
    return found


def test_the_code_folders_are_mapped_under_dataflow(build_py):
    package_dir = build_py.distribution.package_dir
    assert {name: package_dir.get(name) for name in FOLDERS} == FOLDERS
    assert not {"io", "ops", "stages"} & set(build_py.packages)


def test_every_package_folder_is_packaged(build_py):
    on_disk = disk_packages()
    # the ones the hand-written list once left out of the wheel
    assert {"dataflow.costmodel", "dataflow.spatial", "dataflow.ps"} <= set(on_disk)
    assert sorted(build_py.packages) == sorted(on_disk)
    for package, path in on_disk.items():
        assert (ROOT / build_py.get_package_dir(package)).resolve() == path.resolve()


def test_every_module_is_packaged(build_py):
    packaged = {(ROOT / file).resolve() for _, _, file in build_py.find_all_modules()}
    on_disk = {f.resolve() for path in disk_packages().values() for f in path.glob("*.py")}
    assert on_disk - packaged == set()


def test_every_data_file_is_packaged(build_py):
    """A non-Python file the package ships (a preset, a table) must be in package_data."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *FOLDERS.values()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    data = {
        (ROOT / f).resolve()
        for f in listed
        if not f.endswith(".py") and "__pycache__" not in f and (ROOT / f).is_file()
    }
    packaged = {
        (ROOT / src / f).resolve() for _, src, _, files in build_py.data_files for f in files
    }
    assert data - packaged == set(), "add these to [options.package_data] in setup.cfg"
