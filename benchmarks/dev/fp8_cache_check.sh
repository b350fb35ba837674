#!/usr/bin/env bash
# One device call that checks the FP8 e4m3 KV cache (issue 45) and measures it, each step bounded
# so that the whole stays inside BUDGET seconds: the decode kernels (16-bit and e4m3 caches, the
# features the tests use) compiled into CuPy's disk cache in parallel, the FP8 cache's GPU tests
# (tests/gpu/test_kvcache_fp8.py), the benchmark against a bf16 cache
# (benchmarks/fp8_cache_vs_bf16.py), then the 16-bit cache's GPU tests (tests/gpu/test_kvcache.py)
# with what time is left. Logs and results go to OUT; a step the budget leaves no time for is
# skipped with a line that says so.
#
#   OUT=/tmp/out BUDGET=585 bash benchmarks/dev/fp8_cache_check.sh
#   (BENCH_ARGS narrows the benchmark: e.g. BENCH_ARGS="--batches 8 --caches 16384")
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for logs}
BUDGET=${BUDGET:-585}
BENCH_ARGS=${BENCH_ARGS:-}

left() { echo $((BUDGET - SECONDS)); }
# Runs "$@" with at most the time left less $1 seconds kept for what follows; skips it when
# fewer than 20 seconds would remain.
bounded() {
    local keep=$1; shift
    local t=$(( $(left) - keep ))
    if (( t < 20 )); then echo "skipped for want of time: $*"; return 0; fi
    timeout "$t" "$@"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv | tee "$OUT/gpu.txt"
git log --oneline -1 | tee "$OUT/commit.txt"
# (features 0 and softcap + ALiBi + sinks: those of the tests and the benchmark)
bounded 420 python3 benchmarks/dev/prewarm_cache.py --kernels decode decode-e4m3 \
    --features 0 19 2>&1 | tail -3 | tee "$OUT/prewarm.txt"
bounded 200 python3 -m pytest -q -p no:cacheprovider --maxfail 20 \
    tests/gpu/test_kvcache_fp8.py > "$OUT/gpu-tests-fp8.txt" 2>&1
tail -30 "$OUT/gpu-tests-fp8.txt"
# shellcheck disable=SC2086  (BENCH_ARGS: a word list)
bounded 40 python3 benchmarks/fp8_cache_vs_bf16.py --json "$OUT/fp8_cache_vs_bf16.json" \
    $BENCH_ARGS 2>&1 | tee "$OUT/fp8_cache_vs_bf16.txt"
bounded 5 python3 -m pytest -q -p no:cacheprovider --maxfail 20 tests/gpu/test_kvcache.py \
    > "$OUT/gpu-tests-kvcache.txt" 2>&1
tail -5 "$OUT/gpu-tests-kvcache.txt"
echo "done in ${SECONDS} s of ${BUDGET}"
