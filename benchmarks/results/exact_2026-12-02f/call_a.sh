#!/bin/bash
# One device call (2026-12-02): exact attention's fused launch in one loop over the key tiles (merging at split
# edges) with a tree's tail tiles one query at a time (git 466fe7e's kernel copied beside this script as the
# reference: git show 466fe7e:src/ddtree/models/batch_invariant.py > benchmarks/results/exact_2026-12-02f/batch_invariant_before.py);
# the exact kernels' GPU tests, the attention tune at the engine's length buckets, then exact mode's price table
# for what time is left (only if the GPU tests passed).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-02f/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
HERE=benchmarks/results/exact_2026-12-02f
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -8 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 160 python3 benchmarks/exact_attention_tune.py --out "$OUT" --ref "$HERE/batch_invariant_before.py" --bucket \
  2>&1 | tee "$OUT/tune_bucket.log" | cut -c1-420
echo "tune done at ${SECONDS}s"
if grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q "failed\|error" "$OUT/gpu_tests.log"; then
  mkdir -p "$OUT/exact"
  left=$(( 585 - SECONDS ))
  timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 75 ))" \
    >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
  grep '^{"mode"' "$OUT/exact/exact_mode.log" | cut -c1-230
  tail -22 "$OUT/exact/exact_mode.log" | grep '^|' | cut -c1-220
else
  echo "GPU tests did not pass: no price table"
fi
echo "all done at ${SECONDS}s"
