#!/bin/bash
# One device call (2026-12-05): issue 23's two changes of 2026-12-05 against the engine's defaults, in one call on one
# H200: C = 64, four waves, AR / chain / b7 / budget auto.
#   e1:    the defaults (prefill every round, mixing off), contexts 60 and 1k;
#   e3:    --prefill-every 3 (arrivals share prefill steps while others decode), contexts 60 and 1k;
#   m2048: --mixed-chunk 2048 with rounds queued before the flight is read carrying the riders (git 1d6dd21), context 60.
# Run from the repository root with OUT set: bash benchmarks/results/rounds_2026-12-05/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
. benchmarks/results/rounds_2026-12-05/cell.sh
cell e1 60,1024 205
cell e3 60,1024 205 --prefill-every 3
cell m2048 60 $(( 580 - SECONDS )) --mixed-chunk 2048
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
