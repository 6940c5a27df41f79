#!/bin/bash
# One device call (2026-12-04, after call_b.sh): the launch table's first rows through tensor descriptors too (split
# programs of 64 x 128 tiles at 17-192 rows, from call B's tune). The exact kernels' GPU tests, exact attention on
# trees of more than 64 folded rows with programs of 32, 64 and 128 rows (ATTN_LARGE_BLOCK_M; bits against 32), then
# exact mode's price table, every cell of the plan, for the time left (only if the tests passed).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-04/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 200 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -8 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 150 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 32,64,128 2>&1 \
  | tee "$OUT/attention_large.log" | cut -c1-400
echo "attention tune done at ${SECONDS}s"
if grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q "failed\|error" "$OUT/gpu_tests.log"; then
  mkdir -p "$OUT/exact"
  left=$(( 585 - SECONDS ))
  timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 75 ))" \
    >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
  tail -24 "$OUT/exact/exact_mode.log" | grep '^|' | cut -c1-220
else
  echo "GPU tests did not pass: no price table"
fi
echo "all done at ${SECONDS}s"
