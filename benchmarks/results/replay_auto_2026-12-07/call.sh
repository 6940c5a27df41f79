#!/bin/bash
# One device call (2026-12-07): budget auto (with no tree and its probe) measured beside AR, the chain and fixed
# budgets at 64 in flight, greedy, and replay's prediction of every cell, auto's by the engine's own chooser replayed
# over the trace (benchmarks/replay_h200.py --auto; the Qwen3-8B stand-in, bf16, CUDA graphs, curve measured at start).
# Run from the repository root with OUT set: bash benchmarks/results/replay_auto_2026-12-07/call.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
timeout "${LIMIT:-580}" python3 benchmarks/replay_h200.py --out "$OUT/replay" --contexts 60,1024 \
  --concurrency 64 --budgets 3,7 --auto --waves 4 --time-budget "${MATRIX_S:-430}" \
  >"$OUT/replay.log" 2>&1 || echo "replay failed or timed out"
grep -v "^{" "$OUT/replay.log" | grep -v Warning | tail -32 | cut -c1-300
echo "all done at ${SECONDS}s"
