#!/bin/bash
# One device call (2026-12-02, after call_b.sh): the kernel as committed (the fused launch in one loop, a tree's
# tails one query at a time in the tile's program, 3 pipeline stages for one token per row): the exact kernels' GPU
# tests, then exact mode's price table for what time is left (only if the tests passed).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-02f/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 150 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -6 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
if grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q "failed\|error" "$OUT/gpu_tests.log"; then
  mkdir -p "$OUT/exact"
  left=$(( 500 - SECONDS ))
  timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 70 ))" \
    >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
  tail -22 "$OUT/exact/exact_mode.log" | grep '^|' | cut -c1-220
else
  echo "GPU tests did not pass: no price table"
fi
echo "all done at ${SECONDS}s"
