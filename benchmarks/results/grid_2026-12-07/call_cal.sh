#!/bin/bash
# One device call (2026-12-07): budget auto with the size calibration (each size's predicted E against what its
# rounds committed) against auto without it (SIZE_PRIOR 1e12: every factor 1) beside b7, one engine, three repeats:
# C = 32 and 64 at 60 tokens, C = 64 at 1k. On an H100 the curve is the one the H100 measured on the new grid
# earlier the same day (h100_cost_curve.json: no 94 s measurement); on another card it is measured at start.
# Ran at git b204219 (the size calibration, reverted since: SIZE_PRIOR exists only there). Run from the repository
# root with OUT set; LIMIT (s, default 480) bounds the call.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
LIMIT=${LIMIT:-480}
here=benchmarks/results/grid_2026-12-07
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
curve=auto
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && curve=$here/h100_cost_curve.json
timeout $((LIMIT - 10)) python3 benchmarks/auto_ab.py --out "$OUT/cal" --cells 32:60,64:60,64:1024 --budgets 7 \
  --no-ar --repeats 3 --variants "cal: nocal:SIZE_PRIOR=1e12" --cost-curve "$curve" --time-budget $((LIMIT - 50)) \
  > "$OUT/cal.log" 2>&1 || echo "auto_ab.py failed or timed out"
grep -v '^{' "$OUT/cal.log" | grep -v Warning | tail -12
python3 - "$OUT/cal" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/auto_ab.json"))
for r in d["runs"]:
    if r["auto_budgets"]:
        print(r["concurrency"], r["context"], r["config"], r["repeat"], round(r["tok_s"]), r["auto_budgets"],
              "explored", r["explored_rounds"])
PY
echo "all done at ${SECONDS}s"
