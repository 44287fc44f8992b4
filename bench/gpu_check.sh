#!/usr/bin/env bash
# The GPU check of the attention kernels (issue 41: tensor-core decode, q/out in the
# model's dtype, splits merged in the kernel), for one NVIDIA GPU (written for an H200:
# Python 3.12, CuPy 14, torch CUDA, no network, no redis), in under 5 minutes:
#
#   cd <kvcore repo root> && bench/gpu_check.sh
#
# (1) build in place; (2) the attention GPU tests (tests/cuda/test_attention_cuda_gpu.py and
# the attention / graph tests of tests/cuda/test_cuda_backend.py); (3) every other GPU test
# (-m cuda); (4) bench/bench_gpu.py --anchor --quick: decode (batch 1/64 x 4k/32k x
# group 1/4/8) and causal prefill (4k, 16k) of kvcore v3, kvcore v2 (the kernels before
# issue 41, same run) and e4m3fn pages, each beside torch SDPA over a contiguous cache.
# Prints a compact summary last (also in $OUT/summary.md).  Exit 0 when every step
# passed; at most 9 minutes whatever happens (each step has its own timeout), about 4
# when all goes well.  The two modules that need gguf and the SmolLM2 file (no GPU
# test in them) are left out.  Environment: PY (python3), OUT (default /tmp/kvcore_gpu_check),
# KVCORE_GPU_WORKERS (pytest-xdist processes, default 6; 0: one process).
set -uo pipefail
cd "$(dirname "$0")/.." || { echo "gpu_check: cannot enter the repository root"; exit 1; }
PY=${PY:-python3}
OUT=${OUT:-/tmp/kvcore_gpu_check}
mkdir -p "$OUT" || exit 1
T0=$SECONDS
rc=0
: >"$OUT/steps.md"
note() {  # note NAME STATUS DETAIL
    printf '| %s | %s | %ss | %s |\n' "$1" "$2" "$((SECONDS - T0))" "$3" >>"$OUT/steps.md"
    [ "$2" = ok ] || rc=1
}

# a GPU, asked of the driver itself before anything is built (tests/_cuda_env.py)
gpu=$(PYTHONPATH=tests "$PY" -c '
import sys, _cuda_env
visible, detail = _cuda_env.driver_status()
print(detail); sys.exit(0 if visible else 2)' 2>&1)
status=$?
[ "$status" -eq 0 ] || { echo "gpu_check: FAIL: no usable NVIDIA GPU here (${gpu##*$'\n'})"; exit 2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1 \
    || echo "${gpu##*$'\n'}" >"$OUT/gpu.txt"

echo "=== (1) build (t=$((SECONDS - T0))s)"
if timeout 150 "$PY" setup.py build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1; then
    note build ok "setup.py build_ext --inplace"
else
    tail -n 20 "$OUT/build.log"; note build FAIL "see $OUT/build.log"
    cat "$OUT/steps.md"; exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PYTEST=("$PY" -m pytest -q -rfEs -p no:cacheprovider -p no:benchmark --maxfail=30)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout=150)
WORKERS=${KVCORE_GPU_WORKERS:-6}
XDIST=()
[ "$WORKERS" != 0 ] && "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$WORKERS")
summary() {  # the last pytest summary line of a log
    grep -E "(passed|failed|error|skipped|no tests ran)" "$1" | tail -n 1
}
tests() {  # tests NAME LOG CAP ARGS...: a pytest step; fails on a failure or any skip
    local name=$1 log=$2 cap=$3; shift 3
    timeout "$cap" "${PYTEST[@]}" ${XDIST[@]+"${XDIST[@]}"} "$@" >"$log" 2>&1
    local trc=$? last
    last=$(summary "$log")
    tail -n 8 "$log"
    if [ "$trc" -ne 0 ]; then
        note "$name" FAIL "rc $trc: $last"
    elif grep -qE "^SKIPPED" "$log" || ! grep -qE "[0-9]+ passed" <<<"$last"; then
        note "$name" FAIL "skips or nothing run: $last"
    else
        note "$name" ok "$last"
    fi
}

echo "=== (2) attention GPU tests (t=$((SECONDS - T0))s)"
ATTN_K="attention or graph or subnormal"
tests "attention GPU tests" "$OUT/attention.log" 120 -m cuda \
    tests/cuda/test_attention_cuda_gpu.py tests/cuda/test_cuda_backend.py -k "$ATTN_K"

echo "=== (3) the other GPU tests (t=$((SECONDS - T0))s)"
# (test_cuda_backend.py's attention tests run again here: seconds)
tests "other GPU tests" "$OUT/others.log" 120 -m cuda tests \
    --ignore tests/cuda/test_attention_cuda_gpu.py \
    --ignore tests/cli/test_demo_model.py --ignore tests/hf/test_hf_smollm2.py

echo "=== (4) attention against torch SDPA (t=$((SECONDS - T0))s)"
if timeout 150 "$PY" bench/bench_gpu.py --anchor --quick --repeat 1 \
        --json "$OUT/anchor.json" >"$OUT/anchor.md" 2>"$OUT/anchor.err"; then
    note "bench_gpu --anchor" ok "$OUT/anchor.md"
else
    tail -n 15 "$OUT/anchor.err"; note "bench_gpu --anchor" FAIL "see $OUT/anchor.err"
fi

{
    echo "## kvcore bench/gpu_check.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD 2>/dev/null)"
    echo "GPU: $(head -n 1 "$OUT/gpu.txt")"
    echo
    echo "| step | result | at | detail |"
    echo "| --- | --- | ---: | --- |"
    cat "$OUT/steps.md"
    grep -hE "^(FAILED|ERROR) " "$OUT"/attention.log "$OUT"/others.log 2>/dev/null | head -n 20
    echo
    sed -n '/^Attention against torch SDPA/,$p' "$OUT/anchor.md" 2>/dev/null
} >"$OUT/summary.md"
cat "$OUT/summary.md"
[ "$rc" -eq 0 ] && echo "gpu_check: OK in $((SECONDS - T0)) s" \
    || echo "gpu_check: FAIL in $((SECONDS - T0)) s (logs in $OUT)"
exit "$rc"
