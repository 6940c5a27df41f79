#!/bin/bash
# One device call (2026-12-02, after call_a.sh): exact mode's fused matmul with its K segments in one loop
# (MatmulLaunch.flat) against a loop per segment, for o_proj and down, with the exact kernels' matmul GPU tests;
# then exact mode's price table with the fused attention launch (the matmul launches as they were).
# Run from the repository root with OUT set and BUDGET (seconds) for the table:
#   BUDGET=420 bash benchmarks/results/exact_2026-12-02e/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 100 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider \
  -k "split_and_fused" 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 150 python3 benchmarks/exact_matmul_tune.py --out "$OUT/matmul" --weights o_proj,down --splits 4 \
  --cublas-rows 0 --launches split64x128w4,fused128x128w8,flat128x128w8,flat128x128w8s4,flat64x128w4 \
  2>&1 | tee "$OUT/matmul.log" | tail -16 | cut -c1-200
python3 - "$OUT/matmul/exact_matmul_tune.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, e in d["weights"].items():
    for key, v in sorted(e["triton_ms"].items()):
        print(name, key, {m: round(t * 1e3) for m, t in v.items()})
    print(name, "cublas", {m: round(t * 1e3) for m, t in e["cublas_ms"].items()}, e["bits"])
PY
echo "tune done at ${SECONDS}s"
mkdir -p "$OUT/exact"
timeout "$(( BUDGET + 60 ))" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( BUDGET - SECONDS ))" \
  >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed"
tail -22 "$OUT/exact/exact_mode.log" | cut -c1-220
echo "all done at ${SECONDS}s"
