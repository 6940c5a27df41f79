#!/bin/bash
# One device call (2026-12-07): issue 23's C = 64 bar (DDTree at least 1.3x AR at contexts 60 and 1k) with the
# engine's defaults (prefill steps of 2048 tokens, 512 a prompt, prefill_every 3), beside mixed rounds
# (--mixed-chunk 2048: riders under the prefill step's rule, 512 tokens a prompt, mixed graph captures within 5 % of
# the loop's time) on the same engine, alternating, two repeats; then C = 32 at 60 tokens (budgets 4 and 7,
# defaults); then the exact-mode GPU test of mixed rounds (the image has no fastapi: files named).
# Run from the repository root with OUT set: bash benchmarks/results/h200_2026-12-07/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
LIMIT=${LIMIT:-570}
# the C = 64 cells get about 60 % of the call (mixing beside the defaults only if that is 300 s or more)
c64=$((LIMIT * 6 / 10))
settings="steps: mixed:mixed_chunk=2048"
[ $c64 -lt 300 ] && settings=""
timeout $c64 python3 benchmarks/auto_ab.py --out "$OUT/c64" --cells 64:1024,64:60 --budgets 7 --repeats 2 \
  ${settings:+--settings "$settings"} --time-budget $((c64 - 45)) --variants "new:" > "$OUT/c64.log" 2>&1 \
  || echo "auto_ab.py (C=64) failed or timed out"
grep -v '^{' "$OUT/c64.log" | grep -v Warning | tail -16
echo "C=64 done at ${SECONDS}s"
left=$((LIMIT - SECONDS - 80))
if [ $left -gt 100 ]; then
  timeout $left python3 benchmarks/auto_ab.py --out "$OUT/c32" --cells 32:60 --budgets 4,7 --repeats 2 \
    --time-budget $((left - 40)) --variants "new:" > "$OUT/c32.log" 2>&1 || echo "auto_ab.py (C=32) failed or timed out"
  grep -v '^{' "$OUT/c32.log" | grep -v Warning | tail -8
fi
echo "C=32 done at ${SECONDS}s"
timeout $((LIMIT + 10 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_mixed_rounds.py \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"; tail -3 "$OUT/gpu_tests.log" | cut -c1-300
echo "all done at ${SECONDS}s"
