#!/usr/bin/env bash
# The users' workflows of issue 46 on a GPU, in one device call, each step bounded so that the
# whole stays inside BUDGET seconds (the device tool's per-call limit is 600):
#   precompile  `python -m cuflash2 precompile` (the default set) into an emptied cache, timed,
#               with its progress lines; then the head dims `check` adds (256), timed apart
#   check       `python -m cuflash2 check` in a fresh process with that cache; the cache's
#               compiled modules counted before and after (equal: nothing was compiled)
#   train       examples/train_gpt.py at GPT-2 small shapes for TRAIN_SECONDS, with
#               --compare-sdpa (torch SDPA's flash and cuDNN backends in cuflash2's place)
#   examples    tests/gpu/test_examples.py (both examples on tiny shapes)
#   warm        precompile what the benchmark suite adds (features, varlen, decode; no wipe)
#   bench       pytest benchmarks/ --benchmark-only --benchmark-autosave (saved under OUT)
#   compare     the same with --benchmark-compare against that saved run (BENCH_COMPARE_ARGS
#               narrow it, e.g. "-k forward")
# Logs go to OUT (the device tool's $OUT), each starting with the commit and the command. A step
# the budget leaves no time for is skipped with a line saying so; STEPS picks steps. The kernel
# cache is CACHE (default .cupy_cache/workflows in the checkout, git-ignored, so a second call
# on the same warm machine finds it). COMMIT names the commit in the logs where the checkout
# has no .git. Each step has a time cap of its own; all of them may not fit one call's budget,
# so in two calls:
#
#   OUT=$OUT BUDGET=585 STEPS="precompile check train examples" bash benchmarks/dev/workflows_check.sh
#   OUT=$OUT BUDGET=585 STEPS="warm bench compare" bash benchmarks/dev/workflows_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for logs}
BUDGET=${BUDGET:-585}
STEPS=${STEPS:-precompile check train examples warm bench compare}
CACHE=${CACHE:-$PWD/.cupy_cache/workflows}
TRAIN_SECONDS=${TRAIN_SECONDS:-75}
BENCH_COMPARE_ARGS=${BENCH_COMPARE_ARGS:-}
mkdir -p "$OUT" "$CACHE"
export CUPY_CACHE_DIR=$CACHE
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

source benchmarks/dev/bounded_steps.sh  # left, want, bounded, header
# Compiled modules of the cache: every one (CuPy's own kernels land there too), or with `own`
# cuflash2's alone.
cached() {
    python3 -c "from cuflash2 import _environment as e
print(e.cached_modules('$CACHE', own=bool('${1:-}')))"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv | tee "$OUT/gpu.txt"

if want precompile; then
    rm -rf "$CACHE" && mkdir -p "$CACHE"
    log=$OUT/precompile.txt
    header "python -m cuflash2 precompile --cache-dir $CACHE  (from an empty cache)" > "$log"
    echo "planned: $(python3 -m cuflash2 precompile --list | wc -l) specialisations" >> "$log"
    start=$SECONDS
    # The progress line rewrites itself with \r: one line per update in the log.
    bounded 150 python3 -m cuflash2 precompile --cache-dir "$CACHE" 2>&1 | tr '\r' '\n' >> "$log"
    echo "wall: $((SECONDS - start)) s; cached modules: $(cached)" >> "$log"
    echo "# then the head dim check adds: python -m cuflash2 precompile --headdim 256" >> "$log"
    start=$SECONDS
    bounded 90 python3 -m cuflash2 precompile --headdim 256 --cache-dir "$CACHE" 2>&1 \
        | tr '\r' '\n' | tail -2 >> "$log"
    echo "wall: $((SECONDS - start)) s; cached modules: $(cached)" >> "$log"
    grep -v '^\[' "$log"
fi

if want check; then
    log=$OUT/check.txt
    header "python -m cuflash2 check  (fresh process, CUPY_CACHE_DIR=$CACHE)" > "$log"
    before=$(cached); own_before=$(cached own)
    python3 -m cuflash2 info >> "$log" 2>&1
    start=$SECONDS
    bounded 120 python3 -m cuflash2 check >> "$log" 2>&1
    status=$?
    after=$(cached); own_after=$(cached own)
    echo "exit status $status, $((SECONDS - start)) s; cached modules before $before, after" \
         "$after: $((after - before)) compiled during check, $((own_after - own_before)) of" \
         "them cuflash2's ($own_before before, $own_after after; the rest CuPy's own kernels" \
         "of the reference maths)" >> "$log"
    tail -3 "$log"
fi

if want train; then
    log=$OUT/train-gpt.txt
    cmd=(python3 examples/train_gpt.py --steps 3000 --seconds "$TRAIN_SECONDS" --log-every 25
         --compare-sdpa)
    header "${cmd[*]}" > "$log"
    bounded $((TRAIN_SECONDS + 90)) "${cmd[@]}" >> "$log" 2>&1
    echo "exit status $?" >> "$log"
    grep -vE '^step' "$log" | tail -8
fi

if want examples; then
    log=$OUT/examples-tests.txt
    header "python -m pytest -q -rs tests/gpu/test_examples.py" > "$log"
    bounded 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_examples.py \
        >> "$log" 2>&1
    tail -5 "$log"
fi

if want warm; then
    log=$OUT/precompile-bench.txt
    header "precompile of the benchmark suite's features (no wipe)" > "$log"
    start=$SECONDS
    bounded 120 python3 -m cuflash2 precompile --dtype bf16 --headdim 128 \
        --features softcap alibi dropout varlen --cache-dir "$CACHE" 2>&1 | tr '\r' '\n' \
        | tail -2 >> "$log"
    bounded 90 python3 -m cuflash2 precompile --dtype fp16 --headdim 128 --directions decode \
        --cache-dir "$CACHE" 2>&1 | tr '\r' '\n' | tail -2 >> "$log"
    echo "wall: $((SECONDS - start)) s; cached modules: $(cached)" >> "$log"
    cat "$log"
fi

STORAGE=file://$OUT/benchmark-runs
if want bench; then
    log=$OUT/bench-autosave.txt
    header "pytest benchmarks/ --benchmark-only --benchmark-autosave --benchmark-storage=$STORAGE" \
        > "$log"
    bounded 220 python3 -m pytest benchmarks/ -p no:cacheprovider --benchmark-only \
        --benchmark-autosave --benchmark-storage="$STORAGE" --benchmark-columns=min,median,max \
        >> "$log" 2>&1
    echo "exit status $?" >> "$log"
    tail -45 "$log"
fi

if want compare; then
    log=$OUT/bench-compare.txt
    # shellcheck disable=SC2086  (BENCH_COMPARE_ARGS: a word list)
    header "pytest benchmarks/ --benchmark-only --benchmark-compare --benchmark-storage=$STORAGE" \
        "$BENCH_COMPARE_ARGS" > "$log"
    # shellcheck disable=SC2086
    bounded 220 python3 -m pytest benchmarks/ -p no:cacheprovider --benchmark-only \
        --benchmark-compare --benchmark-storage="$STORAGE" --benchmark-columns=min,median,max \
        $BENCH_COMPARE_ARGS >> "$log" 2>&1
    echo "exit status $?" >> "$log"
    tail -60 "$log"
fi
echo "workflows_check: $SECONDS s"
