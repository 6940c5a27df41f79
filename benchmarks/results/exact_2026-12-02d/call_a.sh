#!/bin/bash
# One device call (2026-12-02): exact mode's fused matmul programs with their K segments unrolled (S copies of the
# pipelined K loop) against one loop over the segments, for o_proj and down; the exact kernels' GPU tests.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-02d/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 150 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -4 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 200 python3 benchmarks/exact_matmul_tune.py --out "$OUT/matmul" --weights o_proj,down --splits 1,4 \
  --cublas-rows 0 --launches split64x128w4,fused128x128w8,fused128x128w8loop,fused64x128w4,fused64x128w4loop \
  2>&1 | tee "$OUT/matmul.log" | tail -16 | cut -c1-200
python3 - "$OUT/matmul/exact_matmul_tune.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, e in d["weights"].items():
    for key, v in sorted(e["triton_ms"].items()):
        print(name, key, {m: round(t * 1e3) for m, t in v.items()})
PY
echo "all done at ${SECONDS}s"
