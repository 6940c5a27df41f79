#!/bin/bash
# First device call (2026-12-05, written for the H200, the card issue 23's bars are set on; it ran on one H100, the
# card lent): the arrival knobs at C = 64, four waves, 60-token prompts, against the defaults (as in
# ../rounds_2026-12-05/, the morning's H100 runs).
# AR / b7 / budget auto, no chain (it is far behind at C = 64 and not in the bars).
#   e1:    the defaults (a prefill step every round, mixing off);
#   e3:    --prefill-every 3;
#   m2048: --mixed-chunk 2048 (arrivals' prompts ride in the verify rounds);
#   e3f8:  --prefill-every 3 with the fp8 drafter (draft stage 2.9 of a b7 round's 13.7 ms of stages).
# Run from the repository root with OUT set: bash benchmarks/results/rounds_2026-12-05b/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
. benchmarks/results/rounds_2026-12-05/cell.sh
cell e1 60 140 --no-chain
cell e3 60 140 --no-chain --prefill-every 3
cell m2048 60 140 --no-chain --mixed-chunk 2048
cell e3f8 60 $(( 575 - SECONDS )) --no-chain --prefill-every 3 --draft-fp8
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
