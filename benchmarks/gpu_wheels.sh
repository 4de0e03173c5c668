#!/usr/bin/env bash
# Fills .whl/ with the wheels a lent GPU node needs and cannot fetch (it reaches no
# package registry). Run it here, where pip reaches PyPI, before the GPU call:
#
#   bash benchmarks/gpu_wheels.sh          # ~30 MB into .whl/, then checks they install
#   bash benchmarks/gpu_wheels.sh --list   # only print what it would download
#
# The node (the 'cuda' image: Python 3.12, torch with CUDA, numba-cuda, numpy 2.5) lacks
# dask, distributed, zarr and numcodecs, and numba-cuda breaks on numpy 2.5. So: those
# four and numpy, at the versions installed here (the ones the CPU suite passes with;
# numpy must be < 2.5), and every dependency of theirs (markers read for Python 3.12 on
# Linux) that neither torch nor the image brings. The image's own packages are in
# NODE_HAS below (the device tool's KINDS.md list, read 2026-11-17): when the image
# changes, a missing import in gpu_check.sh's "versions" step names the one to add.
#
# .whl/ is git-ignored (a stray `git add` must never commit 30 MB of wheels), so the
# device call must carry it: run(command="bash benchmarks/gpu_check.sh $OUT",
# carry=[".whl"]). The wheels and the tree together must stay under the tool's 64 MiB.
# Afterwards the wheels are installed into a scratch --target, as gpu_check.sh does on
# the node (--no-index --no-deps, for Python 3.12): one that does not install fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
dest=.whl
NODE_HAS="click cloudpickle fsspec jinja2 markupsafe msgpack packaging psutil pyyaml
sortedcontainers toolz typing-extensions zipp importlib-metadata"

wanted=$("$python" - "$NODE_HAS" <<'EOF'
"""name==version of the roots and their dependencies the node lacks, one a line."""
import re
import sys
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

NODE = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
env = {**default_environment(), **NODE}
torch_brings = {canonicalize_name(Requirement(r).name) for r in requires("torch") or []}
skip = torch_brings | {canonicalize_name(n) for n in sys.argv[1].split()} | {"torch"}
roots = ["dask", "distributed", "zarr", "numcodecs", "numpy"]
todo, seen = list(roots), {}
while todo:
    name = canonicalize_name(todo.pop())
    if name in seen or (name in skip and name not in roots):
        continue
    try:
        seen[name] = version(name)
    except PackageNotFoundError:
        sys.exit(f"gpu_wheels: {name} is not installed here: pip install -e .[test] first")
    for line in requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(req.name)
major, minor = (int(p) for p in re.findall(r"\d+", seen["numpy"])[:2])
if (major, minor) >= (2, 5):
    sys.exit(f"gpu_wheels: numpy {seen['numpy']} here; numba-cuda on the node needs < 2.5")
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
)
if [[ "${1:-}" == --list ]]; then
    echo "$wanted"
    exit 0
fi
echo "gpu_wheels: $(echo "$wanted" | tr '\n' ' ')"
rm -rf "$dest"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# shellcheck disable=SC2086  # one requirement a word
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dest" $wanted
count=$(find "$dest" -type f -name '*.whl' | wc -l)
if ((count != $(echo "$wanted" | wc -l))); then
    echo "gpu_wheels: $count wheels for $(echo "$wanted" | wc -l) requirements" >&2
    exit 1
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# as on the node, for its Python 3.12 whatever runs here (pip checks each wheel's tags)
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    --target "$scratch" "$dest"/*.whl
echo "gpu_wheels: $count wheels, $(du -sh "$dest" | cut -f1) in $dest/, install into a" \
    "scratch --target: ok; carry them: run(..., carry=[\".whl\"])"
