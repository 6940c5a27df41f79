#!/bin/bash
# One device call (2026-12-06, call M): the exact kernels' GPU tests with the small-tile dispatch in two calls
# (the commit after call L), nothing else.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_m.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 170 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -6 \
  | tee "$OUT/gpu_tests.log"
