#!/bin/sh
# Development: warp stall reasons of the backward main kernel (d=$1, s=4k) with Nsight Compute.
M=""
for r in barrier short_scoreboard long_scoreboard mio_throttle math_pipe_throttle wait lg_throttle dispatch_stall not_selected selected tex_throttle no_instruction branch_resolving drain membar misc imc_miss; do
  M="$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
M="${M#,},sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
ncu --clock-control none --kernel-name regex:flash_bwd_kernel --launch-count 1 --metrics "$M" \
    python benchmarks/dev/dev_ncu_one.py "$1"
