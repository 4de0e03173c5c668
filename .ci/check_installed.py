"""Import every module of an installed (not editable) dataflow: .ci/run's wheel check.

Run by the fresh virtual environment's python from outside the checkout, with the copy
of the sources the wheel was built from as the one argument. Fails when a module of
their package folders (setup.cfg's `package_dir`) is missing from the installed package,
when a module does not import, or when any `dataflow` module was loaded from anywhere
but the environment (an editable install's finder would serve a missing one from the
checkout).
"""

import configparser
import importlib
import pkgutil
import sys
from pathlib import Path


def package_dir(sources: Path) -> dict[str, Path]:
    """setup.cfg's `[options] package_dir`: import name -> folder in the sources."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(sources / "setup.cfg", encoding="utf-8")
    mapping = {}
    for line in cfg["options"]["package_dir"].splitlines():
        if line.strip():
            name, _, folder = line.partition("=")
            mapping[name.strip()] = sources / folder.strip()
    return mapping


def source_modules(sources: Path) -> set[str]:
    """Every module the package folders of the sources hold, by import name."""
    names = set()
    for root_name, root in package_dir(sources).items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            # a module counts when every folder down to it is a package, as for setuptools
            if all((root / Path(*parts[:i]) / "__init__.py").is_file() for i in range(len(parts))):
                name = ".".join((root_name, *parts))
                names.add(name.removesuffix(".__init__"))
    return names


def main() -> int:
    sources = Path(sys.argv[1]).resolve()
    env = Path(sys.prefix).resolve()
    failures = []

    import dataflow

    installed = {"dataflow"}
    for info in pkgutil.walk_packages(
        dataflow.__path__, "dataflow.", onerror=lambda name: failures.append((name, "walk"))
    ):
        installed.add(info.name)
    missing = sorted(source_modules(sources) - installed)
    failures += [(name, "in the sources but not in the installed package") for name in missing]

    for name in sorted(installed):
        if name.rsplit(".", 1)[-1] == "__main__":  # importing it would run the program
            continue
        try:
            importlib.import_module(name)
        except Exception as e:
            failures.append((name, f"{type(e).__name__}: {e}"))

    for name, module in sorted(sys.modules.items()):
        if name == "dataflow" or name.startswith("dataflow."):
            file = getattr(module, "__file__", None)
            if file and not Path(file).resolve().is_relative_to(env):
                failures.append((name, f"loaded from {file}, outside {env}"))

    for name, why in failures:
        print(f"FAIL {name}: {why}", file=sys.stderr)
    print(f"{len(installed)} modules of dataflow imported from {Path(dataflow.__file__).parent}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
