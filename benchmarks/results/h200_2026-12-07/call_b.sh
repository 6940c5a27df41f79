#!/bin/bash
# One device call (2026-12-07) on whichever card is lent (the H200 would not start): the GPU tests of mixed rounds
# (exact mode, graphed, riders under the prefill step's rule since git ccb7625) and of the warm-up, then the
# defaults (prefill steps of 2048, 512 a prompt, prefill_every 3) beside mixed rounds (--mixed-chunk 2048, captures
# within 5 % of the loop's time) on one engine, alternating, two repeats, C = 64 at 1k and 60 tokens, b7 and auto.
# Run from the repository root with OUT set: bash benchmarks/results/h200_2026-12-07/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_mixed_rounds.py \
  tests/engine/test_warmup_gpu.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"
tail -3 "$OUT/gpu_tests.log" | cut -c1-300
echo "tests done at ${SECONDS}s"
LIMIT=${LIMIT:-440}
timeout $((LIMIT - SECONDS)) python3 benchmarks/auto_ab.py --out "$OUT/c64" --cells 64:1024,64:60 --budgets 7 \
  --repeats 2 --settings "steps: mixed:mixed_chunk=2048" --time-budget $((LIMIT - 50 - SECONDS)) --variants "new:" \
  > "$OUT/c64.log" 2>&1 || echo "auto_ab.py (C=64) failed or timed out"
grep -v '^{' "$OUT/c64.log" | grep -v Warning | tail -16
echo "all done at ${SECONDS}s"
