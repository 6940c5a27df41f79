#!/bin/bash
# Call A: exact mode's price on a prefill step, and the down projection's launches at prefill row counts.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 300 python3 benchmarks/prefill_price.py --out $OUT/prefill \
  --chunks 1x512@0,1x512@512,2x512@0,1x1024@0,1x2048@0 2>&1 | grep -v Warning | tail -60
timeout 240 python3 benchmarks/exact_matmul_tune.py --out $OUT/down --weights down --splits 4 --cublas-rows 0 \
  --rows 256,384,512,544,640,768,1024,1088,1536,2048 \
  --launches default,tma64x128w4s4,tma128x128w8s4,tma128x256w8s3,tma256x128w8s3,tmasplit128x128w8,tmasplit64x128w4 \
  2>&1 | tail -30
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/down/exact_matmul_tune.json"))
e = r["weights"]["down"]
rows = r["rows"]
print("| launch | " + " | ".join(map(str, rows)) + " |")
print("| cuBLAS | " + " | ".join(f"{e['cublas_ms'][str(m)] * 1e3:.0f}" for m in rows) + " |")
for key, v in e["triton_ms"].items():
    print(f"| {key} | " + " | ".join(f"{v[str(m)] * 1e3:.0f}" for m in rows) + " |")
print("errors", e["errors"])
PY
