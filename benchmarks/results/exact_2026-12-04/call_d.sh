#!/bin/bash
# One device call (2026-12-04, after call_c.sh, the session's last device time): 64-row attention programs for trees
# past 128 folded rows whose grid launches fused (batch_invariant.ATTN_LARGE_BLOCK_M, from call C's tune: a served
# 64-node tree at C = 8). The exact kernels' GPU tests, then the price of DDTree 63 at C = 8 and, for the time left,
# the C = 64 tree cells again (their default rounds moved 20-30 ms between calls B and C).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-04/call_d.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 100 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -8 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
if grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q "failed\|error" "$OUT/gpu_tests.log"; then
  mkdir -p "$OUT/exact"
  left=$(( 320 - SECONDS ))
  timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 60 ))" \
    --cells ddtree:63:8:1024,ddtree:16:64:1024,ddtree:8:64:1024 \
    >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
  grep '^{"mode"' "$OUT/exact/exact_mode.log" | cut -c1-200
  tail -10 "$OUT/exact/exact_mode.log" | grep '^|' | cut -c1-220
else
  echo "GPU tests did not pass: no price table"
fi
echo "all done at ${SECONDS}s"
