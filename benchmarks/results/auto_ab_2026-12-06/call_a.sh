#!/bin/bash
# One device call (2026-12-06): budget auto's exploration slack, 0.10 (git of this folder's commit) against 0.25 (the
# value before), on one engine, alternating, beside b4 and b7, at C = 64 (contexts 60 and 1k) and C = 32 (context 60,
# where auto was 0.941x of b4 on the H200 on 2026-12-01, if the time box leaves it), four waves, three repeats.
# Run from the repository root with OUT set: bash benchmarks/results/auto_ab_2026-12-06/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 430 python3 benchmarks/auto_ab.py --out "$OUT" --cells 64:60,64:1024,32:60 --budgets 4,7 --repeats 3 \
  --time-budget 340 --variants "new:EXPLORE_SLACK=0.10 old:EXPLORE_SLACK=0.25" > "$OUT/auto_ab.log" 2>&1 \
  || echo "auto_ab.py failed or timed out"
grep -v '^{' "$OUT/auto_ab.log" | grep -v Warning | tail -25
echo "all done at ${SECONDS}s"
