#!/bin/bash
# One device call (2026-12-02): exact mode's matmul for o_proj and down without split-K in narrow column tiles, then
# replay's predicted tok/s against measured C = 64 cells (benchmarks/replay_h200.py).
# Run from the repository root with OUT set: bash benchmarks/results/replay_h200_2026-12-02/call.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 150 python3 benchmarks/exact_matmul_tune.py --out "$OUT/matmul" --weights o_proj,down --splits 1,4 \
  --cublas-rows 0 --launches split64x128w4,split64x64w4,fused128x128w8,split64x32w4,split16x32w2,split16x16w1 \
  2>&1 | tee "$OUT/matmul.log" | tail -16 | cut -c1-200
echo "matmul done at ${SECONDS}s"
timeout "$(( 590 - SECONDS ))" python3 benchmarks/replay_h200.py --out "$OUT/replay" --contexts 60,1024 \
  --concurrency 64 --budgets 4,7 --waves 4 --time-budget 290 \
  >"$OUT/replay.log" 2>&1 || echo "replay failed"
grep -v "^{" "$OUT/replay.log" | tail -30 | cut -c1-260
echo "all done at ${SECONDS}s"
