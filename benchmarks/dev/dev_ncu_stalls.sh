#!/bin/sh
# Development: warp stall reasons, tensor-pipe and issue activity of one kernel with Nsight
# Compute, on one call of dev_ncu_one.py:
#   sh benchmarks/dev/dev_ncu_stalls.sh KERNEL_REGEX D [SEQLEN] [causal|full] [fp16|bf16] [fwd|bwd]
# e.g. flash_bwd_sm90_kernel 128 4096 causal fp16 (the Hopper backward), flash_fwd_sm90_kernel
# 64 512 full bf16 fwd (the Hopper forward), flash_bwd_kernel 128 (the mma.sync backward).
KERNEL="$1"
shift
M=""
for r in barrier short_scoreboard long_scoreboard mio_throttle math_pipe_throttle wait lg_throttle dispatch_stall not_selected selected tex_throttle no_instruction branch_resolving drain membar misc imc_miss sleeping; do
  M="$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
M="${M#,},sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum"
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-count 1 --metrics "$M" \
    python benchmarks/dev/dev_ncu_one.py "$@"
