#!/bin/bash
# One device call (2026-12-06, call C): DDTree 16 at 64 in flight (1k) in its steady state, where every round holds
# 64 rows (1088 verify rows): the kernels of served rounds, exact beside default (profile_rounds.py, window from
# the last first token to the first finish; --prefill-every 1 so the prompts start before the first finishes).
# A first try with --new-tokens 2048 --prefill-chunk 2048 had no such window (call_c_profile_c64_first_try.log); the
# run recorded (call_c_profile_c64.log) is the command below, 2048 tokens each and 2048-token prefill steps.
# Run from the repository root with OUT set: bash benchmarks/results/blas_pad_2026-12-06/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 280 python3 benchmarks/profile_rounds.py --out "$OUT/c64" --methods ddtree-16 --concurrency 64 \
  --context 1024 --new-tokens 2048 --prefill-chunk 2048 --prefill-every 1 > "$OUT/c64.log" 2>&1 \
  || echo "profile failed or timed out"
grep "still allocated\|Error" "$OUT/c64.log" | head -5
grep -E "^### |^decode under|round|^\| \`" "$OUT/c64/profile_rounds.md" | head -45 | cut -c1-200
echo "all done at ${SECONDS}s"
