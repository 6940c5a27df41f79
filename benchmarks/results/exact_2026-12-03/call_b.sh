#!/bin/bash
# One device call (2026-12-03, after call_a.sh, the kernel of git 3e40849): where exact mode's price goes in the
# cells that pay most, as served (torch.profiler over the decode rounds, both modes): DDTree 63 at C = 8, then the
# chain and DDTree 16 at C = 64; 1k context, 256 new tokens.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-03/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 230 python3 benchmarks/profile_rounds.py --out "$OUT/c8" --methods ddtree-63 --concurrency 8 --context 1024 \
  > "$OUT/c8.log" 2>&1 || echo "C=8 profile failed or timed out"
grep -A40 "decode under" "$OUT/c8.log" | cut -c1-200 | head -34
echo "C=8 done at ${SECONDS}s"
timeout $(( 560 - SECONDS )) python3 benchmarks/profile_rounds.py --out "$OUT/c64" --methods dflash,ddtree-16 \
  --concurrency 64 --context 1024 > "$OUT/c64.log" 2>&1 || echo "C=64 profile failed or timed out"
grep -A40 "decode under" "$OUT/c64.log" | cut -c1-200 | head -70
echo "all done at ${SECONDS}s"
