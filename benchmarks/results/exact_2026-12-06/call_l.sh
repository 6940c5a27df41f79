#!/bin/bash
# One device call (2026-12-06, call L): the kernel with extra rows removed and small last tiles kept (the launch
# dispatch refactored): every GPU test of the exact kernels, then the tune's table of SHAPES at the engine's key
# buckets with rows at different lengths (--stagger 256), the baseline for the next kernel work.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_l.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 170 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -6 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 230 python3 benchmarks/exact_attention_tune.py --out "$OUT" --bucket --stagger 256 2>&1 \
  | tee "$OUT/attention_tune.log" | sed -E 's/_us=/=/g' | cut -c1-420
echo "all done at ${SECONDS}s"
