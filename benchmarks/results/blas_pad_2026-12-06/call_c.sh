#!/bin/bash
# One device call (2026-12-06, call C): DDTree 16 at 64 in flight (1k) in its steady state, where every round holds
# 64 rows (1088 verify rows): the kernels of served rounds, exact beside default (profile_rounds.py, window from
# the last first token to the first finish; --prefill-every 1 so the prompts start before the first finishes).
# Run from the repository root with OUT set: bash benchmarks/results/blas_pad_2026-12-06/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 270 python3 benchmarks/profile_rounds.py --out "$OUT/c64" --methods ddtree-16 --concurrency 64 \
  --context 1024 --new-tokens 512 --prefill-chunk 512 --prefill-every 1 > "$OUT/c64.log" 2>&1 \
  || echo "profile failed or timed out"
grep "still allocated\|Error" "$OUT/c64.log" | head -5
grep -E "^### |^decode under|round|^\| \`" "$OUT/c64/profile_rounds.md" | head -45 | cut -c1-200
echo "all done at ${SECONDS}s"
