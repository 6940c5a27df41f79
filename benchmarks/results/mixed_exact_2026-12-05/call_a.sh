#!/bin/bash
# One device call (2026-12-05, one H100; no H200 was lent that day): issue 23's mixed rounds at context 1k, C = 64
# (`--mixed-chunk 2048`, AR / b7 / auto, no chain), where the defaults' DDTree rounds spent 97-102 % of their device
# stages again on arrivals' prefill steps; then issue 27's two profiles of where exact mode's price goes at 1k
# (DDTree 63 at one request, DDTree 16 at 64 in flight; each mode's engine dropped before the next starts).
# Run from the repository root with OUT set: bash benchmarks/results/mixed_exact_2026-12-05/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
. benchmarks/results/rounds_2026-12-05/cell.sh
cell m2048_1k 1024 210 --no-chain --mixed-chunk 2048
prof() {  # prof NAME METHODS CONCURRENCY SECONDS [profile_rounds.py flags...]
  local name=$1 methods=$2 conc=$3 secs=$4; shift 4
  timeout "$secs" python3 benchmarks/profile_rounds.py --out "$OUT/$name" --methods "$methods" --concurrency "$conc" \
    --context 1024 "$@" > "$OUT/$name.log" 2>&1 || echo "profile $name failed or timed out"
  echo "$name done at ${SECONDS}s"
  grep "still allocated" "$OUT/$name.log"
  grep -E "^### |^decode under|^\| \`" "$OUT/$name/profile_rounds.md" | head -16 | cut -c1-200
}
prof c1 ddtree-63 1 170 --new-tokens 256
prof c64 ddtree-16 64 $(( 585 - SECONDS )) --new-tokens 512 --prefill-chunk 1024
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
