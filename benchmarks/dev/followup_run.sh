#!/usr/bin/env bash
# The measurements that follow a GPU suite run (gpu_suite_parts.sh) on the same warm machine, in
# one device call, each step bounded so that the whole stays inside BUDGET seconds:
#   flex     benchmarks/programmable_vs_flex.py --only masks, then --only bias evo (issue 44's
#            table: FlexAttention measured in the same run)
#   hdv      benchmarks/head_dim_v_vs_cudnn.py, forward then --backward (d_qk 192 / d_v 128
#            beside cuDNN and cuflash2's own d=192; HDV_ARGS narrow it)
#   dsinks   the float32 "tf32" backward-features tests with the TF32 Hopper forward switched
#            off (CUFLASH2_HOPPER_TF32=0): whether dsinks' error comes from that forward
# Logs go to OUT (at most 8 files: the device tool brings back no more), each starting with the
# commit and the command. STEPS picks steps; a step the budget leaves no time for is skipped
# with a line saying so.
#
#   OUT=$OUT BUDGET=585 STEPS="flex hdv dsinks" bash benchmarks/dev/followup_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for logs}
BUDGET=${BUDGET:-585}
STEPS=${STEPS:-flex hdv dsinks}
HDV_ARGS=${HDV_ARGS:---seqlens 1024 4096 16384 --dtypes bf16 --rounds 3 --iters 10}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"

source benchmarks/dev/bounded_steps.sh  # left, want, bounded, header

nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw \
    --format=csv | tee "$OUT/followup-gpu.txt"
if want flex; then
    for only in "masks" "bias evo"; do
        log=$OUT/flex-${only// /-}.txt
        header "python3 benchmarks/programmable_vs_flex.py --iters 10 --only $only" > "$log"
        bounded 240 python3 benchmarks/programmable_vs_flex.py --iters 10 --only $only \
            >> "$log" 2>&1
        tail -12 "$log"
    done
fi
if want hdv; then
    log=$OUT/head-dim-v.txt
    header "python3 benchmarks/head_dim_v_vs_cudnn.py $HDV_ARGS [--backward]" > "$log"
    bounded 150 python3 benchmarks/head_dim_v_vs_cudnn.py $HDV_ARGS >> "$log" 2>&1
    bounded 150 python3 benchmarks/head_dim_v_vs_cudnn.py $HDV_ARGS --backward >> "$log" 2>&1
    tail -20 "$log"
fi
if want dsinks; then
    log=$OUT/dsinks-tf32.txt
    header "CUFLASH2_HOPPER_TF32=0 python3 -m pytest -q tests/gpu/test_float32.py -k 'backward_features and tf32'" > "$log"
    bounded 90 env CUFLASH2_HOPPER_TF32=0 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_float32.py -k "backward_features and tf32" >> "$log" 2>&1
    tail -5 "$log"
fi
echo "followup_run: ${SECONDS} s"
