#!/bin/bash
# One device call (2026-12-06, call E, git a7ea91f): exact mode's price with the split launch's chunk programs and
# a chunk per query where that launch runs, at one request and at 8 in flight (where the chain, DDTree 4 and 16 take
# the split launch and DDTree 63 the fused one); the AR reference first.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_e.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "$OUT/exact"
timeout 380 python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget 340 \
  --cells ddtree:63:1:1024,ddtree:16:1:1024,dflash:0:8:1024,ddtree:4:8:1024,ddtree:16:8:1024,ddtree:63:8:1024 \
  >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
grep '^|' "$OUT/exact/exact_mode.log" | cut -c1-220
echo "all done at ${SECONDS}s"
