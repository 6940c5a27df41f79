#!/bin/bash
# One device call (2026-12-03, after call_b.sh, the kernel of git 3e40849, validated in call_a.sh): exact mode's
# price table, every cell of the plan, for the time the call has.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-03/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
mkdir -p "$OUT/exact"
timeout 585 python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget 505 \
  >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
tail -22 "$OUT/exact/exact_mode.log" | grep '^|' | cut -c1-220
echo "all done at ${SECONDS}s"
