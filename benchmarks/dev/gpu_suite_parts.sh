#!/usr/bin/env bash
# The whole GPU suite in one bounded device call: the kernels compiled into CuPy's disk cache
# in parallel first (prewarm_cache.py, the e4m3 decode and float32 kernels too), then the test
# files in PARTS pytest processes side by side (their time is mostly each test's own NVRTC
# compiles on one core; the GPU work is small), with the compute-sanitizer suite beside them.
# Logs go to OUT, at most 8 files (what the device tool brings back): setup.txt (the GPU and the
# prewarm), part-<i>.txt (each part's files and pytest log), summary.txt (the counts of every
# part and the sanitizer's log).
#
#   OUT=$OUT BUDGET=585 PARTS=6 bash benchmarks/dev/gpu_suite_parts.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for logs}
BUDGET=${BUDGET:-585}
PARTS=${PARTS:-6}
PREWARM_SECONDS=${PREWARM_SECONDS:-240}

left() { echo $((BUDGET - SECONDS)); }
LOGS=$(mktemp -d)  # the sanitizer's log, kept out of OUT until the summary takes it
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/setup.txt"
# (the feature sets of device_check.sh's prewarm: those the suite runs)
timeout "$PREWARM_SECONDS" python3 benchmarks/dev/prewarm_cache.py \
    --kernels fwd bwd decode decode-e4m3 float32 \
    --features ${FEATURES:-0 1 2 3 4 5 6 7 8 12 16 17 18 19 20 23 24 1024 2048 3072 3091} 2>&1 | tail -c 400 \
    >> "$OUT/setup.txt"
tail -c 200 "$OUT/setup.txt"
(timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_sanitizer.py > "$LOGS/sanitizer.txt" 2>&1 &)
# The files, largest first by their test count, dealt round-robin to the parts.
mapfile -t files < <(for f in tests/gpu/test_*.py; do
    [[ $f == tests/gpu/test_sanitizer.py ]] && continue
    echo "$(grep -c "^def test_\|^    def test_" "$f") $f"; done | sort -rn | cut -d' ' -f2)
pids=()
for ((i = 0; i < PARTS; i++)); do
    part=()
    for ((j = i; j < ${#files[@]}; j += PARTS)); do part+=("${files[$j]}"); done
    { echo "# ${part[*]}"
      timeout $(( $(left) - 15 )) python3 -m pytest -q -p no:cacheprovider -rf --maxfail 200 \
          "${part[@]}" 2>&1; } > "$OUT/part-$i.txt" &
    pids+=($!)
done
wait "${pids[@]}"
for _ in $(seq 5); do grep -qE "passed|failed|error" "$LOGS/sanitizer.txt" && break; sleep 2; done
{ for ((i = 0; i < PARTS; i++)); do
      head -1 "$OUT/part-$i.txt"; grep -E "^FAILED|^ERROR| passed| failed| error" "$OUT/part-$i.txt" | tail -12
  done
  echo "# sanitizer"; tail -40 "$LOGS/sanitizer.txt"
  echo "gpu_suite_parts: ${SECONDS} s"; } | tee "$OUT/summary.txt"
