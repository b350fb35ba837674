#!/bin/sh
# Development: per-instruction warp stall sampling of one kernel with Nsight Compute, on one call
# of dev_ncu_one.py, as CSV (the SASS with its samples by stall reason) and the details page:
#   OUT=DIR sh benchmarks/dev/dev_ncu_source.sh NAME KERNEL_REGEX D [SEQLEN] [causal|full] [fp16|bf16] [fwd|bwd]
# e.g. bwd128 flash_bwd_sm90_kernel 128 4096 full fp16 -> DIR/bwd128_sass.csv, DIR/bwd128_details.csv
NAME="$1"
KERNEL="$2"
shift 2
DIR="${OUT:-.}"
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section ComputeWorkloadAnalysis \
    -o "$DIR/$NAME" -f python benchmarks/dev/dev_ncu_one.py "$@" || exit 1
ncu -i "$DIR/$NAME.ncu-rep" --page source --csv --print-source sass > "$DIR/${NAME}_sass.csv"
ncu -i "$DIR/$NAME.ncu-rep" --page details --csv > "$DIR/${NAME}_details.csv"
