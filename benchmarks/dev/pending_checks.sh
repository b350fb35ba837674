#!/usr/bin/env bash
# The GPU checks of kernels written and checked on the CPU only (docs/GPU_PENDING.md), in one
# device call, each step bounded so that the whole stays inside BUDGET seconds:
#   tests     TESTS_A (default tests/gpu/test_fp8_forward.py; first failure stops it) and
#             TESTS_B (default the README examples with tests/gpu/test_mla_decode.py), in two
#             pytest processes side by side, with compute-sanitizer memcheck, racecheck and
#             synccheck over sanitizer_workload.py's `--only $SANITIZE` (default `fp8
#             mla_decode`; `all`: the whole workload) beside them, and fp8_variants_ab.py run
#             once at one iteration (head and BASE) to compile its kernels, with `timing`
#   timing    benchmarks/dev/fp8_variants_ab.py --variants $AB_VARIANTS (default: the dispatched
#             FP8 forward and the wider key tiles of E4M3_WIDE_TILES) on the checkout, then
#             --variants disp on BASE (a folder holding another version of the repository, e.g.
#             `mkdir ab_base && git archive main | tar -x -C ab_base`, carried to the device), on
#             the same machine, cuDNN's FP8 SDPA beside both where the frontend's wheel is at
#             WHEEL (installed under /tmp/site)
#   mla       benchmarks/mla_decode.py --no-torch on the checkout, then on BASE
#   rotary    benchmarks/dev/decode_graph_sweep.py --rotary (issue 47: the rotary append's cost
#             in a decode step at batch 1, 4k tokens, at most 10%), then on BASE
# Logs go to OUT (at most 8 files), each starting with the commit and the command.
#
#   OUT=$OUT BUDGET=585 BASE=ab_base WHEEL=.whl COMMIT=<hash> bash benchmarks/dev/pending_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder for logs}
BUDGET=${BUDGET:-585}
STEPS=${STEPS:-tests timing mla rotary}
BASE=${BASE:-}
WHEEL=${WHEEL:-}
AB_VARIANTS=${AB_VARIANTS:-disp w192 w224}
TESTS_A=${TESTS_A:-tests/gpu/test_fp8_forward.py}
TESTS_B=${TESTS_B:-tests/gpu/test_readme_examples.py tests/gpu/test_mla_decode.py}
SANITIZE=${SANITIZE:-fp8 mla_decode}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
source benchmarks/dev/bounded_steps.sh  # left, want, bounded, header

SITE=
if [[ -n $WHEEL ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEEL"/*.whl > /dev/null 2>&1 && SITE=:/tmp/site
fi
export PYTHONPATH=$PWD$SITE PYTHONUNBUFFERED=1
LOGS=$(mktemp -d)
summary=$OUT/pending-summary.txt
header "pending_checks.sh STEPS=\"$STEPS\" BASE=$BASE" > "$summary"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$summary"

if want tests; then
    t=$(( $(left) - 200 )); (( t > 330 )) && t=330
    warm=(--rounds 1 --iters 1 --warmup 1 --no-cudnn)
    if want timing; then  # (the FP8 timing's kernels compiled under the tests)
        python3 benchmarks/dev/fp8_variants_ab.py --variants $AB_VARIANTS "${warm[@]}" \
            > "$LOGS/warm-head.txt" 2>&1 &
        [[ -n $BASE ]] && { python3 "$BASE/benchmarks/dev/fp8_variants_ab.py" --variants disp \
            "${warm[@]}" > "$LOGS/warm-base.txt" 2>&1 & }
    fi
    pytest=(timeout "$t" python3 -m pytest -q -p no:cacheprovider -rf)
    "${pytest[@]}" -x $TESTS_A > "$OUT/tests-a.txt" 2>&1 &
    "${pytest[@]}" $TESTS_B > "$OUT/tests-b.txt" 2>&1 &
    only=(--only $SANITIZE)
    [[ $SANITIZE == all ]] && only=()
    for tool in memcheck racecheck synccheck; do
        { timeout "$t" compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 99 \
              python3 tests/gpu/sanitizer_workload.py "${only[@]}" 2>&1 | tail -30
          echo "exit: ${PIPESTATUS[0]}"; } > "$LOGS/sanitizer-$tool.txt" &
    done
    wait
    for f in "$OUT"/tests-*.txt "$LOGS"/sanitizer-*.txt "$LOGS"/warm-*.txt; do
        echo "## $(basename "$f")"
        grep -E "^FAILED|^ERROR|Error|passed|failed|SUMMARY|exit:|workload done" "$f" | tail -15
    done >> "$summary"
    echo "tests: ${SECONDS} s" >> "$summary"
fi
if want timing; then
    log=$OUT/fp8-timing.txt
    header "fp8_variants_ab.py --variants $AB_VARIANTS (head), --variants disp (BASE=$BASE)" > "$log"
    reserve=0; want mla && reserve=100  # seconds kept for the mla and rotary steps
    want rotary && reserve=$((reserve + 60))
    half=$(( ($(left) - 10 - reserve) / 2 ))
    # (the script puts its own repository first on sys.path: BASE's runs BASE's package)
    echo "## head" >> "$log"
    bounded "$half" python3 benchmarks/dev/fp8_variants_ab.py --variants $AB_VARIANTS \
        >> "$log" 2>&1
    if [[ -n $BASE ]]; then
        echo "## base ($BASE)" >> "$log"
        bounded $(( $(left) - 5 - reserve )) python3 "$BASE/benchmarks/dev/fp8_variants_ab.py" \
            --variants disp \
            >> "$log" 2>&1
    fi
fi
if want mla; then
    log=$OUT/mla-decode.txt
    header "benchmarks/mla_decode.py --no-torch (head, then BASE=$BASE)" > "$log"
    bounded 120 python3 benchmarks/mla_decode.py --no-torch >> "$log" 2>&1
    [[ -n $BASE ]] && bounded 120 python3 "$BASE/benchmarks/mla_decode.py" --no-torch \
        >> "$log" 2>&1
    tail -12 "$log"
fi
if want rotary; then
    log=$OUT/rotary-cost.txt
    header "benchmarks/dev/decode_graph_sweep.py --rotary" > "$log"
    bounded 60 python3 benchmarks/dev/decode_graph_sweep.py --rotary >> "$log" 2>&1
    [[ -n $BASE ]] && { echo "## base ($BASE)" >> "$log"
        bounded 60 python3 "$BASE/benchmarks/dev/decode_graph_sweep.py" --rotary >> "$log" 2>&1; }
    tail -6 "$log"
fi
echo "pending_checks: ${SECONDS} s" >> "$summary"
cat "$summary"
