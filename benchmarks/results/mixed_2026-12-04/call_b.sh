#!/bin/bash
# One device call (2026-12-04): graphed mixed rounds (RoundGraphs.run_mixed: the chunk's layers graph per round key
# and chunk bucket). The exact-mode mixed-round GPU test first (bits against AR alone, graphed mixed rounds), then
# C = 64 at contexts 60 and 1k, four waves, AR / chain / b7 / budget auto, with mixed rounds of 256 prompt tokens
# and, in the same call, without them (mixed_chunk 0: prefill steps of their own, as before).
# Run from the repository root with OUT set: bash benchmarks/results/mixed_2026-12-04/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 100 python3 -m pytest -q -m gpu tests/engine/test_mixed_rounds.py -p no:cacheprovider 2>&1 | tail -4 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
for m in 256 0; do
  if [ "$m" = 256 ]; then left=$(( (590 - SECONDS) / 2 + 20 )); else left=$(( 590 - SECONDS )); fi
  timeout "$left" python3 benchmarks/gpu.py --out "$OUT/m$m" --no-hf --auto --contexts 60,1024 --concurrency 64 \
    --budgets 7 --waves 4 --mixed-chunk "$m" --time-budget $(( left - 90 )) > "$OUT/m$m.log" 2>&1 \
    || echo "gpu.py (mixed $m) failed or timed out"
  echo "mixed $m done at ${SECONDS}s"
  grep "^| 64" "$OUT/m$m.log" | cut -d'|' -f1-6,10-12 | head -12
done
echo "all done at ${SECONDS}s"
