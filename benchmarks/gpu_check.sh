#!/usr/bin/env bash
# The one GPU check: run it first whenever a CUDA GPU is lent.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. installs the wheels in .whl/ (if any) into /tmp/site: a GPU node that reaches no
#    package registry gets dask, distributed, zarr and numpy<2.5 (numba-cuda needs it)
#    carried in as wheels, see benchmarks/README.md "One GPU";
# 2. installs this checkout without dependencies (editable);
# 3. runs the `gpu` tests (pytest -m gpu);
# 4. runs bench_gpu.py with every side (kernels; training: fit from memory and zarr in
#    each precision and mode against hand-written loops) and writes OUT_DIR/gpu.json;
# 5. runs profile_gpu.py: the replica worker's stack samples during a fit (host time).
#
# Each step's log lands in OUT_DIR (default benchmarks/results/gpu_check). A step that
# fails does not stop the later ones; the exit status is the number of failed steps.
# DATAFLOW_GPU_CHECK_DRY=1 prints the commands instead of running them (tests use it on
# machines without a GPU, so the script is never first run on a lent GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-benchmarks/results/gpu_check}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
dry="${DATAFLOW_GPU_CHECK_DRY:-0}"
bench_args="${DATAFLOW_GPU_BENCH_ARGS:-}"
failed=0

run() {  # run NAME CMD...: CMD's output to the terminal and OUT/NAME.log
    local name="$1"
    shift
    echo "== $name: $*"
    if [[ "$dry" == 1 ]]; then
        return 0
    fi
    local started=$SECONDS
    PYTHONUNBUFFERED=1 "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    if [[ $rc != 0 ]]; then
        failed=$((failed + 1))
    fi
}

if compgen -G ".whl/*.whl" >/dev/null; then
    run wheels "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
run install "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
run versions "$python" -c "import torch, numpy, dask, zarr, numba; import dataflow;
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '-');
print('numpy', numpy.__version__, 'dask', dask.__version__, 'zarr', zarr.__version__,
      'numba', numba.__version__)"
run gpu_tests "$python" -m pytest -m gpu -q -p no:cacheprovider --timeout=240 tests
# shellcheck disable=SC2086  # bench_args is a list of words
run bench "$python" benchmarks/bench_gpu.py --out "$out/gpu.json" $bench_args
# where a fit's host time goes (the fit was host-bound on the H100: see benchmarks/README.md)
run profile "$python" benchmarks/profile_gpu.py --out "$out/profile" --top 30
echo "== gpu_check: $failed step(s) failed; logs and gpu.json in $out"
exit "$failed"
