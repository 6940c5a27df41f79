#!/bin/bash
# Third device call (2026-12-05, one H100): --mixed-chunk 2048 at context 1k, where call B's defaults spent 97-102 %
# of a DDTree round past its device stages on arrivals' prefill steps; then, if the time box allows, mixing and
# --prefill-every 3 together at context 60.
# Run from the repository root with OUT set: bash benchmarks/results/rounds_2026-12-05/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
. benchmarks/results/rounds_2026-12-05/cell.sh
cell m2048_1k 1024 200 --mixed-chunk 2048
cell m2048_e3_60 60 $(( 320 - SECONDS )) --mixed-chunk 2048 --prefill-every 3
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
