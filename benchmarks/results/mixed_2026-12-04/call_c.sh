#!/bin/bash
# One device call (2026-12-04): call B's graphed mixed rounds again after the mend of git 0688788 (the first
# tokens' head ran outside inference mode and failed every graphed mixed round, whose reruns then met a device
# assert). The exact-mode mixed-round GPU test first, with CUDA_LAUNCH_BLOCKING=1 so a device assert names its
# kernel; then C = 64 at 60 and 1k with mixed rounds of 256 tokens (call B has the same cells with mixed_chunk 0).
# Run from the repository root with OUT set: bash benchmarks/results/mixed_2026-12-04/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
CUDA_LAUNCH_BLOCKING=1 timeout 110 python3 -m pytest -q -x -m gpu tests/engine/test_mixed_rounds.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
grep -v "^frame\|Warning" "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|error|File|assert" | head -30 | cut -c1-300
echo "tests done at ${SECONDS}s"
left=$(( 575 - SECONDS ))
timeout "$left" python3 benchmarks/gpu.py --out "$OUT/m256" --no-hf --auto --contexts 60,1024 --concurrency 64 \
  --budgets 7 --waves 4 --mixed-chunk 256 --time-budget $(( left - 80 )) > "$OUT/m256.log" 2>&1 \
  || echo "gpu.py (mixed 256) failed or timed out"
grep "^| 64" "$OUT/m256.log" | cut -d'|' -f1-6,10-12 | head -12
grep -v "^{\|^frame\|Warning\|^|" "$OUT/m256.log" | grep -E "Error|error|assert|mixed round" | head -8 | cut -c1-300
echo "all done at ${SECONDS}s"
