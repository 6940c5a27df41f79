#!/bin/bash
# One device call (2026-12-04, after call_a.sh): the launch table with tensor-descriptor loads from 129 rows (64 x
# 128 flat tiles up to 640 rows, 128 x 256 with 8 warps past it; batch_invariant.MATMUL_LAUNCHES). The exact kernels'
# GPU tests (every launch of both tables at every row count 1..2048 against the pointer wide launch), split programs
# with descriptor loads timed at 16-320 rows for the table's first rows, then exact mode's price table, every cell
# of the plan, for the time left (only if the tests passed).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-04/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 200 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -8 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 120 python3 benchmarks/exact_matmul_tune.py --out "$OUT" --weights o_proj,down --splits 4 --cublas-rows 0 \
  --rows 16,32,64,128,192,256,320 \
  --launches split16x64w4,split64x64w4,split64x128w4,tmasplit16x64w4,tmasplit64x64w4,tmasplit64x128w4,tmasplit64x128w4s3,tmasplit32x128w4,tmasplit128x128w8,tma64x128w4s4,tma128x128w8s4 \
  > "$OUT/matmul_tune.log" 2>&1 || echo "matmul tune failed or timed out"
grep -v "^|" "$OUT/matmul_tune.log" | tail -4 | cut -c1-400
python3 - "$OUT/exact_matmul_tune.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for name, e in r["weights"].items():
    rows = [str(m) for m in r["rows"]]
    print(name, "rows  ", " ".join(f"{m:>4}" for m in rows))
    print(name, "cuBLAS", " ".join(f"{e['cublas_ms'][m] * 1e3:4.0f}" for m in rows))
    for key, v in sorted(e["triton_ms"].items()):
        print(f"  {key:22s}", " ".join(f"{v[m] * 1e3:4.0f}" for m in rows))
    print("  errors", {k: v[:80] for k, v in e["errors"].items()})
PY
echo "tune done at ${SECONDS}s"
if grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q "failed\|error" "$OUT/gpu_tests.log"; then
  mkdir -p "$OUT/exact"
  left=$(( 585 - SECONDS ))
  timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 75 ))" \
    >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
  tail -24 "$OUT/exact/exact_mode.log" | grep '^|' | cut -c1-220
else
  echo "GPU tests did not pass: no price table"
fi
echo "all done at ${SECONDS}s"
