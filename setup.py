"""The package list, derived from the folders on disk (setup.cfg holds everything else).

setup.cfg's `package_dir` maps each code folder under the one import package `dataflow`
(`stages/` -> `dataflow.stages`, `io/` -> `dataflow.io`, ...: a bare `io` would shadow
the standard library). setuptools' own `find:` cannot prefix a folder's packages with
such a name, so this file does: every folder holding an `__init__.py` below a mapped
folder is packaged, in editable installs and wheels alike, and a new subpackage needs
no edit here. tests/test_packaging.py checks the result against the folders on disk.
"""

import configparser
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def package_dir(root: str = HERE) -> dict[str, str]:
    """setup.cfg's `[options] package_dir`: import name -> folder (relative to root)."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(os.path.join(root, "setup.cfg"), encoding="utf-8")
    mapping = {}
    for line in cfg["options"]["package_dir"].splitlines():
        if line.strip():
            name, _, folder = line.partition("=")
            mapping[name.strip()] = folder.strip()
    return mapping


def packages(root: str = HERE) -> list[str]:
    """Each mapped package and every package found below its folder, by import name."""
    found = set()
    for name, folder in package_dir(root).items():
        found.add(name)
        found.update(f"{name}.{sub}" for sub in find_packages(os.path.join(root, folder)))
    return sorted(found)


setup(packages=packages())
