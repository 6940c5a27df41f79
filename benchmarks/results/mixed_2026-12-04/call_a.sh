#!/bin/bash
# One device call (2026-12-04): mixed rounds (EngineConfig.mixed_chunk, prompt chunks riding in decode rounds'
# verify forwards). GPU tests first: exact-mode mixed rounds against AR alone in bf16 (tests/engine/test_mixed_rounds.py),
# graphed rounds against eager (test_cuda_graphs.py), the exact kernels (test_batch_invariant.py, with the descriptor
# launches' bias / masked-K test). Then C = 64 at contexts 60 and 1k, four waves, with mixed rounds of MIXED tokens
# (budget auto, b4, b7, AR, the chain), as the budget-auto fourth run measured them without.
# Run from the repository root with OUT set: MIXED=256 bash benchmarks/results/mixed_2026-12-04/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
MIXED=${MIXED:-256}
TESTS=${TESTS:-1}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
if [ "$TESTS" = 1 ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/engine/test_mixed_rounds.py tests/engine/test_cuda_graphs.py \
    tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
  echo "tests done at ${SECONDS}s"
fi
left=$(( 585 - SECONDS ))
timeout "$left" python3 benchmarks/gpu.py --out "$OUT/c64" --no-hf --auto --contexts 60,1024 --concurrency 64 \
  --budgets 4,7 --waves 4 --mixed-chunk "$MIXED" --time-budget $(( left - 120 )) > "$OUT/c64.log" 2>&1 \
  || echo "gpu.py failed or timed out"
grep "^|" "$OUT/c64.log" | head -30
tail -3 "$OUT/c64.log" | cut -c1-300
echo "all done at ${SECONDS}s"
