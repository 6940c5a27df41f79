#!/bin/bash
# One device call (2026-12-05): EngineConfig.prefill_every's new CUDA default (None: 3) checked on the GPU. The GPU
# tests of the engine and the speculative ops (CUDA graphs, joiners, mixed rounds, exact mode, warm-up), then the
# 60-token cell at C = 64 with no arrival flag (AR / b7 / auto, no chain), which should read as the afternoon's
# --prefill-every 3 cell (../rounds_2026-12-05b/e3.log) did.
# Run from the repository root with OUT set: bash benchmarks/results/defaults_2026-12-05/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 300 python3 -m pytest -q -m gpu tests/engine tests/speculative -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1 \
  || echo "GPU tests failed or timed out"
tail -3 "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
. benchmarks/results/rounds_2026-12-05/cell.sh
cell defaults 60 $(( 560 - SECONDS )) --no-chain
grep -o '"prefill_every": [0-9a-z]*' "$OUT/defaults/gpu.json" | head -1
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
