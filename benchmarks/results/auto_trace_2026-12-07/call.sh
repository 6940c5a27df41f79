#!/bin/bash
# One device call, prepared on 2026-12-07 (run once on an H100 later that day; its output was not kept, see
# docs/benchmarks.md, "Budget auto's predictions against its rounds"): budget auto traced
# (auto_ab.py --trace: per read auto round, the chooser's expected lengths E(c) at the choice against what the
# round's rows committed for every candidate c up to its size) in four variants: "base" (the defaults: observed
# lengths as totals per size, the curve's prices), "steps" (a row's observed lengths kept as steps,
# auto_budget.STEPS=1), "off" (the rounds' time past the curve's price added to every option's price, OFFSET=1) and
# "fast" (observed lengths decaying by 0.7 a round, GAIN_DECAY=0.7, exploration scaled to it), beside AR and b7 on
# one engine, two repeats: C = 32 and 64 at 60 tokens, C = 64 at 1k. Also the first GPU run of
# the chooser's lighter host work (git d0908e1). On an H100 the curve is the one an H100 measured on the new grid
# (benchmarks/results/grid_2026-12-07/h100_cost_curve.json: no 94 s measurement); on another card it is measured at
# start. Run from the repository root with OUT set; LIMIT (s, default 540) bounds the call; CELLS (default
# 32:60,64:60,64:1024) names the cells, BUDGETS (default 7) the fixed budgets, VARIANTS (default the four above) the
# auto variants; no run starts later than TAIL s (default 60) before LIMIT.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
LIMIT=${LIMIT:-540}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
curve=auto
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && curve=benchmarks/results/grid_2026-12-07/h100_cost_curve.json
timeout $((LIMIT - 10)) python3 benchmarks/auto_ab.py --out "$OUT/trace" --cells "${CELLS:-32:60,64:60,64:1024}" --budgets "${BUDGETS:-7}" \
  --repeats 2 --variants "${VARIANTS:-base: steps:STEPS=1 off:OFFSET=1 fast:GAIN_DECAY=0.7,EXPLORE_EVIDENCE=0.02}" --trace \
  --cost-curve "$curve" --time-budget $((LIMIT - ${TAIL:-60})) > "$OUT/trace.log" 2>&1 || echo "auto_ab.py failed or timed out"
grep -v '^{' "$OUT/trace.log" | grep -v Warning | tail -20
python3 - "$OUT/trace" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/auto_ab.json"))
for r in d["runs"]:
    if r.get("trace"):
        print(r["concurrency"], r["context"], r["config"], r["repeat"], round(r["tok_s"]), r["auto_budgets"])
        for size, s in r["trace"].items():
            print("   size", size, s)
PY
echo "all done at ${SECONDS}s"
