#!/bin/bash
# One device call (2026-12-03): exact attention's tail tiles gathered once per chunk of queries on one path
# (batch_invariant.tail_chunks) instead of once per query, in both launches. The kernel before (git 15bcc79's,
# copied beside this script: git show 15bcc79:src/ddtree/models/batch_invariant.py > batch_invariant_before.py) is
# the reference: the same bits are expected (ref_same_bits). The exact kernels' GPU tests, the attention tune at
# the engine's length buckets, then the price of the tree cells for what time is left (only if the tests passed).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-03/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
HERE=benchmarks/results/exact_2026-12-03
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -8 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 170 python3 benchmarks/exact_attention_tune.py --out "$OUT" --ref "$HERE/batch_invariant_before.py" --bucket \
  2>&1 | tee "$OUT/tune_bucket.log" | cut -c1-420
echo "tune done at ${SECONDS}s"
if grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q "failed\|error" "$OUT/gpu_tests.log"; then
  mkdir -p "$OUT/exact"
  left=$(( 585 - SECONDS ))
  timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 75 ))" \
    --cells ddtree:8:64:1024,ddtree:16:64:1024,ddtree:4:64:1024,ddtree:16:8:1024,ddtree:63:8:1024 \
    >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
  grep '^{"mode"' "$OUT/exact/exact_mode.log" | cut -c1-230
  tail -12 "$OUT/exact/exact_mode.log" | grep '^|' | cut -c1-220
else
  echo "GPU tests did not pass: no price table"
fi
echo "all done at ${SECONDS}s"
