#!/bin/bash
# One device call (written 2026-12-05, not run that day: no device was lent): where exact mode's price goes in the
# cells that still pay most after the tenth run (docs/benchmarks.md, "Exact mode"): DDTree 63 at one request (84 %:
# its round 7.39 against 6.31 ms, of which the tune's kernels explain about 0.15 ms) and DDTree 16 at 64 in flight
# (78-83 %), both at 1k. profile_rounds.py lists the served rounds' kernels of both modes side by side, every
# request decoding in its window. Then the exact kernels' GPU tests.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-05/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
prof() {  # prof NAME METHODS CONCURRENCY SECONDS
  timeout "$4" python3 benchmarks/profile_rounds.py --out "$OUT/$1" --methods "$2" --concurrency "$3" \
    --context 1024 --new-tokens 256 > "$OUT/$1.log" 2>&1 || echo "profile $1 failed or timed out"
  echo "$1 done at ${SECONDS}s"
  grep -E "^### |^decode under|^\| \`" "$OUT/$1/profile_rounds.md" | head -16 | cut -c1-200
}
prof c1 ddtree-63 1 200
prof c64 ddtree-16 64 240
timeout $(( 570 - SECONDS )) python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log" | cut -c1-300
echo "all done at ${SECONDS}s"
