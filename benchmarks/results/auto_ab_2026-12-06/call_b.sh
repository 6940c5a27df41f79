#!/bin/bash
# Second device call (2026-12-06): the same A/B as call_a.sh at 8k (C = 64, where auto was 0.935x of b4 on the H200
# on 2026-12-02, then C = 32), one wave, two repeats, prefill chunk 1024. C = 64 at 8k needs an H200's memory.
# Run from the repository root with OUT set: bash benchmarks/results/auto_ab_2026-12-06/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 450 python3 benchmarks/auto_ab.py --out "$OUT" --cells 64:8192,32:8192 --budgets 4,16 --repeats 2 --waves 1 \
  --prefill-chunk 1024 --time-budget 370 --variants "new:EXPLORE_SLACK=0.10 old:EXPLORE_SLACK=0.25" \
  > "$OUT/auto_ab.log" 2>&1 || echo "auto_ab.py failed or timed out"
grep -v '^{' "$OUT/auto_ab.log" | grep -v Warning | tail -25
echo "all done at ${SECONDS}s"
