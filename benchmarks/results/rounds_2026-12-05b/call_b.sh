#!/bin/bash
# Second device call (2026-12-05, written for the H200; not run: no H200 came, the morning's H100 runs had the 1k
# cells but mixing, and mixing at 1k ran in ../mixed_exact_2026-12-05/): the same knobs at 1k-token prompts, where
# the defaults' DDTree rounds took about twice their device stages (arrivals' prefill steps) and replay bounds DDTree
# at 1.25x AR.
# Run from the repository root with OUT set: bash benchmarks/results/rounds_2026-12-05b/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
. benchmarks/results/rounds_2026-12-05/cell.sh
cell e1_1k 1024 185 --no-chain
cell m2048_1k 1024 185 --no-chain --mixed-chunk 2048
cell e3_1k 1024 $(( 575 - SECONDS )) --no-chain --prefill-every 3
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
