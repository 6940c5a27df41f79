#!/bin/bash
# One device call (2026-12-02, after call_b.sh): exact mode's wide matmul launch now one K loop over the segments
# (MatmulLaunch.flat, 4 stages; call_b timed it) beside the fused attention launch: the matmul GPU tests, then exact
# mode's price table. Run from the repository root with OUT set and BUDGET (seconds) for the table:
#   BUDGET=470 bash benchmarks/results/exact_2026-12-02e/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 100 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider \
  -k "split_and_fused or linear_rows" 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
mkdir -p "$OUT/exact"
timeout "$(( BUDGET + 60 ))" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( BUDGET - SECONDS ))" \
  >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed"
tail -22 "$OUT/exact/exact_mode.log" | cut -c1-220
echo "all done at ${SECONDS}s"
