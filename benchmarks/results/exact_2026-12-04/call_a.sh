#!/bin/bash
# One device call (2026-12-04): the exact matmul's wide launch. Wider flat tiles and the flat launch with its tiles
# loaded by tensor descriptors (MatmulLaunch.tma), timed against cuBLAS on o_proj and down at the row counts of
# verifies (128-2048), bits checked against the split launch; the exact kernels' GPU tests first (they now include
# the TMA and 128 x 256 launches at every row count 1..2048, single_chunks and the equal-paths mend of git
# ca24187); then a profile of the C = 8 cells that pay most (the chain, DDTree 63), every request decoding.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-04/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 230 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -8 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 200 python3 benchmarks/exact_matmul_tune.py --out "$OUT" --weights o_proj,down --splits 4 --cublas-rows 0 \
  --rows 128,320,512,768,1024,2048 \
  --launches split64x64w4,split64x128w4,flat128x128w8s4,flat128x256w8,flat256x128w8,flat128x128w4s4,flat64x256w4,tma128x128w8s4,tma128x256w8s3,tma128x256w8s4,tma256x128w8s3,tma64x128w4s4,tma64x256w4s3 \
  > "$OUT/matmul_tune.log" 2>&1 || echo "matmul tune failed or timed out"
grep -v "^|" "$OUT/matmul_tune.log" | tail -6 | cut -c1-600
grep "^|" "$OUT/matmul_tune.log"
python3 - "$OUT/exact_matmul_tune.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for name, e in r["weights"].items():
    rows = [str(m) for m in r["rows"]]
    print(name, "cuBLAS", " ".join(f"{e['cublas_ms'][m] * 1e3:.0f}" for m in rows))
    for key, v in sorted(e["triton_ms"].items()):
        print(f"  {key:22s}", " ".join(f"{v[m] * 1e3:.0f}" for m in rows))
    print("  errors", {k: v[:80] for k, v in e["errors"].items()})
PY
echo "tune done at ${SECONDS}s"
left=$(( 580 - SECONDS ))
timeout "$left" python3 benchmarks/profile_rounds.py --out "$OUT/c8" --methods dflash,ddtree-63 --concurrency 8 \
  --context 1024 > "$OUT/c8.log" 2>&1 || echo "C=8 profile failed or timed out"
grep -A40 "decode under" "$OUT/c8.log" | cut -c1-200 | head -60
echo "all done at ${SECONDS}s"
