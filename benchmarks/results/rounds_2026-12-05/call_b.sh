#!/bin/bash
# Second device call (2026-12-05, one H100): call A's e1 ran out of its time box before context 1k, so the defaults
# at 1k here; then --prefill-every 3 at context 60 again (call A's auto 1.43x AR there), to see it repeat.
# Run from the repository root with OUT set: bash benchmarks/results/rounds_2026-12-05/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
. benchmarks/results/rounds_2026-12-05/cell.sh
cell e1_1k 1024 230
cell e3_60 60 $(( 440 - SECONDS )) --prefill-every 3
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
