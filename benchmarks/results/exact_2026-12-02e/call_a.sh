#!/bin/bash
# One device call (2026-12-02): exact attention's fused launch (each program merges its own splits, no partials)
# against the split launch and against the kernel before it (git a98a064, copied beside this script:
#   git show a98a064:src/ddtree/models/batch_invariant.py > benchmarks/results/exact_2026-12-02e/batch_invariant_before.py),
# at exact key counts and at the engine's length buckets; the exact kernels' GPU tests; the cuBLAS chunk probe.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-02e/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
HERE=benchmarks/results/exact_2026-12-02e
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -6 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 120 python3 benchmarks/exact_attention_tune.py --out "$OUT" --ref "$HERE/batch_invariant_before.py" \
  2>&1 | tee "$OUT/tune.log" | cut -c1-300
timeout 120 python3 benchmarks/exact_attention_tune.py --out "$OUT" --ref "$HERE/batch_invariant_before.py" --bucket \
  2>&1 | tee "$OUT/tune_bucket.log" | cut -c1-300
echo "tune done at ${SECONDS}s"
timeout "$(( 580 - SECONDS ))" python3 benchmarks/cublas_chunk_probe.py --out "$OUT" 2>&1 | tee "$OUT/probe.log" \
  | cut -c1-300
echo "all done at ${SECONDS}s"
