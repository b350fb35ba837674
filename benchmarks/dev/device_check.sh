#!/usr/bin/env bash
# One device call that checks a change and measures it, each step bounded so that the whole
# stays inside BUDGET seconds (the device tool's per-call limit is 600): the kernels compiled
# into CuPy's disk cache in parallel (prewarm_cache.py), the GPU suite beside the
# compute-sanitizer suite, then the paper grid A/B of the checkout against a base version of the
# package (ab_packages.py, forward then backward, with SDPA's cuDNN backend), then the cost of
# the sinks (sinks_cost.py), the programmable kernels' GPU tests ("mods", a pytest a file side
# by side) and their timing next to FlexAttention ("flex", benchmarks/programmable_vs_flex.py).
# Logs and results go to OUT (the device tool's $OUT). A step that the budget leaves no time for
# is skipped with a line that says so; STEPS picks steps (the default: the first five).
#
#   OUT=/tmp/out BASE=ab_base BUDGET=585 STEPS="prewarm suite ab-fwd ab-bwd sinks" \
#       AB_ARGS="--seqlens 4096 16384" SINKS_ARGS="--dtypes bf16" bash benchmarks/dev/device_check.sh
# (AB_ARGS and SINKS_ARGS narrow the A/B's and the sinks' grids: the options of ab_packages.py
# and sinks_cost.py.)
set -uo pipefail
# shellcheck disable=SC2086  (AB_ARGS, SINKS_ARGS, FLEX_ARGS, FEATURES: word lists)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for logs}
BASE=${BASE:-ab_base}
BUDGET=${BUDGET:-585}
STEPS=${STEPS:-prewarm suite ab-fwd ab-bwd sinks}
ROUNDS=${ROUNDS:-2}
FEATURES=${FEATURES:-0 1 2 3 4 5 6 7 8 12 16 17 18 19 20 23 24}
AB_ARGS=${AB_ARGS:-}
SINKS_ARGS=${SINKS_ARGS:-}
FLEX_ARGS=${FLEX_ARGS:-}

left() { echo $((BUDGET - SECONDS)); }
want() { [[ " $STEPS " == *" $1 "* ]]; }
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
if want prewarm; then
    # shellcheck disable=SC2086
    # (PREWARM_KEEP: the seconds kept for the steps after it)
    bounded "${PREWARM_KEEP:-300}" python3 benchmarks/dev/prewarm_cache.py --features $FEATURES \
        2>&1 | tail -3 \
        | tee "$OUT/prewarm.txt"
fi
if want suite; then
    (bounded 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sanitizer.py \
        > "$OUT/sanitizer.txt" 2>&1 &)
    # SUITE_FIRST: test files run before the rest of the suite (what a change is about).
    bounded 60 python3 -m pytest -q -p no:cacheprovider --maxfail 40 ${SUITE_FIRST:-} tests/gpu \
        --ignore tests/gpu/test_sanitizer.py > "$OUT/gpu-tests.txt" 2>&1
    tail -40 "$OUT/gpu-tests.txt"
    for _ in $(seq 60); do
        grep -qE "passed|failed|error|skipped" "$OUT/sanitizer.txt" && break
        sleep 2
    done
    tail -5 "$OUT/sanitizer.txt"
fi
for direction in fwd bwd; do
    if want "ab-$direction"; then
        bounded 5 python3 benchmarks/dev/ab_packages.py --base "$BASE" --direction "$direction" \
            --rounds "$ROUNDS" --cudnn --json "$OUT/ab-$direction.json" $AB_ARGS \
            > "$OUT/ab-$direction.md" 2>&1
        tail -12 "$OUT/ab-$direction.md"
    fi
done
if want sinks; then
    bounded 2 python3 benchmarks/sinks_cost.py --rounds "$ROUNDS" $SINKS_ARGS \
        > "$OUT/sinks-cost.md" 2>&1
    tail -8 "$OUT/sinks-cost.md"
fi
if want mods; then
    # The programmable kernels' GPU tests (issue 44), before the benchmark that uses them: one
    # pytest a part of a file, side by side, since their time is mostly NVRTC compiling each
    # test's own kernels on one CPU core (the disk cache is shared; a kernel two parts compile is
    # compiled twice at worst).
    # Eight parts (the device's 16 cores): a part is "file[:-k expression]".
    parts=("test_programmable" "test_block_mask:hopper_backward"
           "test_block_mask:not hopper_backward" "test_bias:hopper and bf16"
           "test_bias:hopper and fp16" "test_bias:not hopper" "test_readme_examples"
           "test_packed")
    pids=()
    for i in "${!parts[@]}"; do
        f=${parts[$i]%%:*}; k=${parts[$i]#"$f"}; k=${k#:}
        bounded "${MODS_KEEP:-70}" python3 -m pytest -q -p no:cacheprovider -rf --maxfail 20 \
            "tests/gpu/$f.py" ${k:+-k "$k"} > "$OUT/mods-$i-$f.txt" 2>&1 &
        pids+=($!)
    done
    wait "${pids[@]}"
    for i in "${!parts[@]}"; do
        echo "== ${parts[$i]}"; tail -6 "$OUT/mods-$i-${parts[$i]%%:*}.txt"
    done
fi
if want flex; then
    # FLEX_ARGS: benchmarks/programmable_vs_flex.py's options (--only masks bias evo).
    bounded 2 python3 benchmarks/programmable_vs_flex.py --iters 10 $FLEX_ARGS \
        > "$OUT/vs-flex.md" 2> "$OUT/vs-flex.err"
    cat "$OUT/vs-flex.md"
    tail -3 "$OUT/vs-flex.err"
fi
echo "device_check: ${SECONDS} s"
