#!/bin/bash
# Third device call (2026-12-05), written for one H100 (no H200 came): call A's two profiles of where exact mode's
# price goes, both at 1k, each mode's engine now dropped before the next starts (profile_rounds.py logs the GiB
# still allocated). DDTree 63 at one request (84 % of the default's tok/s on the H200) and DDTree 16 at 64 in flight
# (78-83 %); the C = 64 profile with 1024-token prefill chunks (two engines' caches then fit 80 GB even if the first
# stays) and 512 new tokens (so all 64 requests decode together before the first ones finish).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-05/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
prof() {  # prof NAME METHODS CONCURRENCY SECONDS [profile_rounds.py flags...]
  local name=$1 methods=$2 conc=$3 secs=$4; shift 4
  timeout "$secs" python3 benchmarks/profile_rounds.py --out "$OUT/$name" --methods "$methods" --concurrency "$conc" \
    --context 1024 "$@" > "$OUT/$name.log" 2>&1 || echo "profile $name failed or timed out"
  echo "$name done at ${SECONDS}s"
  grep "still allocated" "$OUT/$name.log"
  grep -E "^### |^decode under|^\| \`" "$OUT/$name/profile_rounds.md" | head -16 | cut -c1-200
}
prof c64 ddtree-16 64 300 --new-tokens 512 --prefill-chunk 1024
prof c1 ddtree-63 1 $(( 570 - SECONDS )) --new-tokens 256
echo "all done at ${SECONDS}s"
