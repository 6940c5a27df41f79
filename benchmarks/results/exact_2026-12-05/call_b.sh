#!/bin/bash
# Device call (2026-12-05, one H100; call A's two profiles did not fit the day's device time): where exact mode's
# price goes in DDTree 16 at 64 in flight, 1k (78-83 % on the H200): profile_rounds.py lists the served rounds'
# kernels of both modes side by side. Then the exact kernels' GPU tests.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-05/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 260 python3 benchmarks/profile_rounds.py --out "$OUT/c64" --methods ddtree-16 --concurrency 64 \
  --context 1024 --new-tokens 256 > "$OUT/c64.log" 2>&1 || echo "profile c64 failed or timed out"
echo "c64 done at ${SECONDS}s"
grep -E "^### |^decode under|^\| \`" "$OUT/c64/profile_rounds.md" | head -24 | cut -c1-200
timeout $(( 420 - SECONDS )) python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log" | cut -c1-300
echo "all done at ${SECONDS}s"
