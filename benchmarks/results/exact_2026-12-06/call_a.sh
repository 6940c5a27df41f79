#!/bin/bash
# One device call (2026-12-06): exact attention with 16-row programs beside 32 and 64 (attention_block_m replaced
# per call; bits against 32-row programs) on trees and chains as served, then exact mode's price on the cells the
# 16-row rule would touch (DDTree 16 and 63 at C = 1, DDTree 63 at C = 8; the AR reference runs first) with the
# engine's rule as it is: the before of call B.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 16,32,64 2>&1 \
  | tee "$OUT/attention_block_m.log" | cut -c1-600
echo "attention tune done at ${SECONDS}s"
mkdir -p "$OUT/exact"
left=$(( 570 - SECONDS ))
timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 60 ))" \
  --cells ddtree:63:1:1024,ddtree:16:1:1024,ddtree:63:8:1024 >"$OUT/exact/exact_mode.log" 2>&1 \
  || echo "exact_mode failed or timed out"
grep '^|' "$OUT/exact/exact_mode.log" | cut -c1-220
echo "all done at ${SECONDS}s"
