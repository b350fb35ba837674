#!/usr/bin/env bash
# Forward and backward benchmark on the FlashAttention-2 paper grid next to torch SDPA's
# FlashAttention-2 (SDPA-flash) and cuDNN backends;
# writes benchmarks/results/<date>-<gpu>.{json,md}.
# Usage: benchmarks/run_bench.sh [gpu-tag] [bench options, default --direction both]
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-h200}
shift || true
[[ $# -gt 0 ]] || set -- --direction both
stem="benchmarks/results/$(date -u +%Y-%m-%d)-${tag}"
mkdir -p benchmarks/results
{ echo '```'; ${PYTHON:-python3} -m cuflash2 info; echo '```'; } > "$stem.md"
# The markdown report goes to stdout (and the file); per-row progress goes to stderr.
${PYTHON:-python3} -m cuflash2 bench --compare torch --json "$stem.json" "$@" | tee -a "$stem.md"
echo "wrote $stem.md and $stem.json" >&2
