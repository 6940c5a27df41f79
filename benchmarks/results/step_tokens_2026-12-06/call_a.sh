#!/bin/bash
# One device call (2026-12-06): prefill steps of 2048 tokens (EngineConfig.prefill_step_tokens, the new CUDA default;
# 512 tokens a prompt as before) against steps of 512 (the engine before it: one 512-token step a round), on one
# engine, alternating, at C = 64 (contexts 1k and 60) and, if the time box leaves it, C = 32 (context 60, default
# steps), two repeats; then the GPU tests of prefill steps and the warm-up (the image has no fastapi: files named).
# Run from the repository root with OUT set: bash benchmarks/results/step_tokens_2026-12-06/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
git log -1 --format=%h 2>/dev/null
timeout 320 python3 benchmarks/auto_ab.py --out "$OUT/c64" --cells 64:1024,64:60 --budgets 7 --repeats 2 \
  --step-tokens 512,2048 --time-budget 260 --variants "new:" > "$OUT/c64.log" 2>&1 \
  || echo "auto_ab.py (C=64) failed or timed out"
grep -v '^{' "$OUT/c64.log" | grep -v Warning | tail -16
echo "C=64 done at ${SECONDS}s"
left=$((390 - SECONDS - 70))
if [ $left -gt 90 ]; then
  timeout $left python3 benchmarks/auto_ab.py --out "$OUT/c32" --cells 32:60 --budgets 4,7 --repeats 2 \
    --time-budget $((left - 40)) --variants "new:" > "$OUT/c32.log" 2>&1 || echo "auto_ab.py (C=32) failed or timed out"
  grep -v '^{' "$OUT/c32.log" | grep -v Warning | tail -8
fi
echo "C=32 done at ${SECONDS}s"
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_warmup_gpu.py tests/engine/test_cuda_graphs.py \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"; tail -5 "$OUT/gpu_tests.log"
echo "all done at ${SECONDS}s"
