#!/usr/bin/env bash
# Issue 40's GPU check, one script for one NVIDIA GPU (written for an H200: Python 3.12,
# torch CUDA, CuPy 14, transformers, no network), within about 4 minutes:
#   (1) build kvcore in place (skipped when the built extension imports),
#   (2) tests/hf/test_hf_cuda.py (kvcore.hf on a CUDA pool: DynamicCache's tokens, torch's
#       stream, the step lane's plans, CUDA graph capture and replay, cached prefixes),
#   (3) the end-to-end benchmark, quick: bench/bench_hf.py --device cuda --quick
#       (Llama-3.2-1B shape, bf16, batch 1 and 16, prompt 1024, 128 new tokens; DynamicCache
#       + sdpa, static cache + torch.compile, kvcore eager and with graphs; issue 40's goals),
# and prints the benchmark's table last.  Logs in $OUT (default /tmp/kvcore_hf_gpu).
#
#   cd <kvcore repo root> && bash bench/gpu_hf_check.sh
#
# Environment: PY (python3), OUT, HF_BENCH_ARGS (extra bench arguments, e.g.
# "--no-compile" when torch.compile takes too long), SKIP_TESTS=1, SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-python3}
OUT=${OUT:-/tmp/kvcore_hf_gpu}
mkdir -p "$OUT"
T0=$SECONDS
rc=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stamp() { printf '\n=== %s (t=%ds)\n' "$1" "$((SECONDS - T0))"; }

stamp "(1) build"
if "$PY" -c "import kvcore._native._pool, kvcore.backends.cpu._kernels" 2>/dev/null; then
    echo "built already"
elif ! timeout 200 "$PY" setup.py -q build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -n 20 "$OUT/build.log"; echo "gpu_hf_check: FAIL: build (see $OUT/build.log)"; exit 1
fi
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/versions.log"
import cupy, torch, transformers, kvcore
print(f"GPU {torch.cuda.get_device_name(0)}; torch {torch.__version__}, CuPy {cupy.__version__},"
      f" transformers {transformers.__version__}, kvcore {kvcore.__file__}")
PYEOF

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    stamp "(2) tests/hf/test_hf_cuda.py"
    # in 4 processes when pytest-xdist is there: most of the time is NVRTC compiling
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
    timeout 170 "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark -rfEs \
        ${XDIST[@]+"${XDIST[@]}"} tests/hf/test_hf_cuda.py >"$OUT/tests.log" 2>&1
    trc=$?
    tail -n 25 "$OUT/tests.log"
    if [ "$trc" -ne 0 ] || grep -qE "^SKIPPED" "$OUT/tests.log"; then
        echo "gpu_hf_check: tests FAILED or skipped (rc $trc; see $OUT/tests.log)"; rc=1
    fi
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
    stamp "(3) bench/bench_hf.py --device cuda --quick"
    # shellcheck disable=SC2086
    timeout 300 "$PY" bench/bench_hf.py --device cuda --quick --repeat 1 \
        --json "$OUT/bench_hf_gpu.json" ${HF_BENCH_ARGS:-} >"$OUT/bench.md" 2>"$OUT/bench.err"
    brc=$?
    [ "$brc" -eq 0 ] || { tail -n 15 "$OUT/bench.err"; echo "gpu_hf_check: bench FAILED (rc $brc)"; rc=1; }
    stamp "the table"
    cat "$OUT/bench.md"
fi
echo "gpu_hf_check: $([ $rc -eq 0 ] && echo OK || echo FAIL) in $((SECONDS - T0)) s; logs in $OUT"
exit $rc
