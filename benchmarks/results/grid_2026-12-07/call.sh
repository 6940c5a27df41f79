#!/bin/bash
# One device call (2026-12-07): budget auto on the cost curve's new grid (every rows bucket and every node bucket
# auto chooses from, budget 1 included; a drafting budget never interpolated toward AR's point) against the same
# measurements on the grid engine start measured before (--old-grid: rows 1/4/16/64, budgets 0/3/15/32, read the
# old way), beside AR, b3 and b7, on one engine, two repeats: C = 64 at 60 and 1k tokens (issue 23's 1.3x AR bar),
# C = 32 at 60 tokens. Run from the repository root with OUT set; LIMIT (s, default 540) bounds the call.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
LIMIT=${LIMIT:-540}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout $((LIMIT - 10)) python3 benchmarks/auto_ab.py --out "$OUT/grid" --cells 64:60,64:1024,32:60 --budgets 3,7 \
  --repeats 2 --old-grid --variants "new:" --time-budget $((LIMIT - 70)) > "$OUT/grid.log" 2>&1 \
  || echo "auto_ab.py failed or timed out"
grep -v '^{' "$OUT/grid.log" | grep -v Warning | tail -22
python3 - "$OUT/grid" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/auto_ab.json"))
c = json.load(open(sys.argv[1] + "/cost_curve.json"))
print("engine start s", round(d["engine_start_s"], 1), "curve measure s", round(c["measure_seconds"], 1),
      "grid", c["rows"], c["budgets"], c["kv_lens"])
for r in d["runs"]:
    if r["auto_budgets"]:
        print(r["concurrency"], r["context"], r["config"], r["repeat"], round(r["tok_s"]), r["auto_budgets"],
              "explored", r["explored_rounds"])
PY
echo "all done at ${SECONDS}s"
