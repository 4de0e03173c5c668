#!/usr/bin/env bash
# The one GPU check: run it first whenever a CUDA GPU is lent. One call, at most
# DATAFLOW_GPU_CHECK_BUDGET seconds (340: a 6-minute call with room to spare):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. installs the wheels in .whl/ (if any) into /tmp/site: a GPU node that reaches no
#    package registry gets dask, distributed, zarr and numpy<2.5 (numba-cuda needs it)
#    carried in as wheels. Before the call, here: `bash benchmarks/gpu_wheels.sh` fills
#    .whl/ (git-ignored), and the device call carries it:
#    run(command="bash benchmarks/gpu_check.sh $OUT", carry=[".whl"]); see
#    benchmarks/README.md "One GPU check";
# 2. installs this checkout without dependencies (editable);
# 3. runs bench_gpu.py (the figures first): the small CNN, ResNet-50 and CosmoFlow, each
#    fit (eager and capture=True) against its hand loop in fp32 and bf16 + channels_last,
#    captured bf16 + channels_last first, from memory and zarr, the small CNN's Adaptive
#    and compiled sides, then the kernels if time is left; one run in OUT_DIR/gpu.json
#    with the commit, ratios, issue 37's targets and host ms per stage
#    (OUT_DIR/gpu.partial.json holds the sides done if the step is cut short);
# 4. runs the `gpu` tests (pytest -m gpu), for as long as step 3 left them;
# 5. runs profile_gpu.py: the replica worker's stack samples during a fit (host time).
#
# Each step has a time limit (cut to what the budget has left; SIGINT first, so pytest
# prints its summary and the bench its partial JSON); a step with under 10 s left is
# skipped. Each step's log lands in OUT_DIR (default benchmarks/results/gpu_check). A
# step that fails does not stop the later ones; the exit status is the number of
# failed (or timed-out) steps. DATAFLOW_GPU_CHECK_DRY=1 prints the commands instead of
# running them (tests use it on machines without a GPU, so the script is never first
# run on a lent GPU). DATAFLOW_COMMIT names the commit where the copy has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-benchmarks/results/gpu_check}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
dry="${DATAFLOW_GPU_CHECK_DRY:-0}"
bench_args="${DATAFLOW_GPU_BENCH_ARGS:---budget-s 150}"
budget="${DATAFLOW_GPU_CHECK_BUDGET:-340}"
deadline=$((SECONDS + budget))
DATAFLOW_COMMIT="${DATAFLOW_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}"
export DATAFLOW_COMMIT
failed=0

run() {  # run NAME LIMIT CMD...: CMD, for at most LIMIT s, its output to OUT/NAME.log too
    local name="$1" limit="$2"
    shift 2
    local left=$((deadline - SECONDS))
    if ((limit > left)); then
        limit=$left
    fi
    if ((limit < 10)); then
        echo "== $name: skipped: the check's $budget s are spent"
        return 0
    fi
    echo "== $name (at most $limit s): $*"
    if [[ "$dry" == 1 ]]; then
        return 0
    fi
    local started=$SECONDS
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 |
        tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    if [[ $rc == 124 || $rc == 137 ]]; then
        echo "== $name: cut at its limit of $limit s"
    fi
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    if [[ $rc != 0 ]]; then
        failed=$((failed + 1))
    fi
}

if compgen -G ".whl/*.whl" >/dev/null; then
    run wheels 60 "$python" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_check: no wheels in .whl/: where the node lacks dask, run" \
        "benchmarks/gpu_wheels.sh here and pass carry=[\".whl\"] to the call"
fi
run install 60 "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
run versions 30 "$python" -c "import torch, numpy, dask, zarr, numba; import dataflow;
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '-');
print('numpy', numpy.__version__, 'dask', dask.__version__, 'zarr', zarr.__version__,
      'numba', numba.__version__)"
# the figures first: a call cut short still has them (bench_gpu stops starting sides
# after --budget-s, then adds the kernels only if they fit)
# shellcheck disable=SC2086  # bench_args is a list of words
run bench 200 "$python" benchmarks/bench_gpu.py --out "$out/gpu.json" $bench_args
# a test module whose import fails on the node (a package it lacks) costs only its own tests;
# in one process (one GPU; and the node has no pytest-xdist: pyproject's -n is dropped)
run gpu_tests 100 "$python" -m pytest -o "addopts=-ra --strict-markers" -m gpu -q \
    -p no:cacheprovider --timeout=60 --continue-on-collection-errors tests
# where a fit's host time goes (the fit was host-bound on the H100: see benchmarks/README.md)
run profile 40 "$python" benchmarks/profile_gpu.py --out "$out/profile" --top 30 --epochs 4
echo "== gpu_check: $failed step(s) failed after $SECONDS s; logs and gpu.json in $out"
exit "$failed"
