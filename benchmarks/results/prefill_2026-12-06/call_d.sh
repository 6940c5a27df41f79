#!/bin/bash
# Call D: exact mode's price on issue 27's cells (AR, the chain and DDTree at one request over 1k and 4k keys, and at
# 64 in flight over 1k) with the matmul table of git be39f86 and the attention as before call C.
# Run from the repository root with OUT set: bash benchmarks/results/prefill_2026-12-06/call_d.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "$OUT/price"
timeout 460 python3 benchmarks/exact_mode.py --out "$OUT/price" --time-budget 380 \
  --cells dflash:0:1:1024,ddtree:16:1:1024,ar:0:64:1024,dflash:0:64:1024,ddtree:8:64:1024,ddtree:63:1:1024,ar:0:1:4096,dflash:0:1:4096,ddtree:32:1:4096 \
  >"$OUT/price/exact_mode.log" 2>&1 || echo "price failed or timed out"
grep '^|' "$OUT/price/exact_mode.log" | tail -n +3 | cut -c1-220
python3 - "$OUT/price/exact_mode.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("skipped", d.get("skipped"), "errors", d.get("cell_errors"))
for c in d["cells"]:
    print(c["mode"], c["method"], c["budget"], c["concurrency"], c["context"], f"round {c['round_ms']:.2f} ms, stages",
          {k: round(v, 2) for k, v in c["stage_ms_per_round"].items()})
PY
echo "all done at ${SECONDS}s"
