#!/bin/bash
# One device call (2026-12-02, git e6f0758): exact attention storing only the partials a row's combine reads (its
# queries loaded only for those rows) against the kernel before, at exact key counts and at the engine's length
# buckets; the exact kernels' GPU tests; then exact mode's price table.
# The kernel before is a copy made beside this script first (the device has no git history):
#   git show 38f1ad9:src/ddtree/models/batch_invariant.py > benchmarks/results/exact_2026-12-02c/batch_invariant_before.py
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-02c/call.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
HERE=benchmarks/results/exact_2026-12-02c
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -4 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 120 python3 benchmarks/exact_attention_tune.py --out "$OUT" --ref "$HERE/batch_invariant_before.py" \
  2>&1 | tee "$OUT/tune.log" | cut -c1-250
timeout 120 python3 benchmarks/exact_attention_tune.py --out "$OUT" --ref "$HERE/batch_invariant_before.py" --bucket \
  2>&1 | tee "$OUT/tune_bucket.log" | cut -c1-250
echo "tune done at ${SECONDS}s"
mkdir -p "$OUT/exact"
timeout "$(( 590 - SECONDS ))" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( 525 - SECONDS ))" \
  >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed"
tail -24 "$OUT/exact/exact_mode.log" | cut -c1-220
echo "all done at ${SECONDS}s"
