#!/bin/bash
# Budget auto predicted beside measured on the CPU demo pair (2026-12-07): the demo sweep (auto included), the
# trace of its own prompts, and replay's prediction of every cell with two curves: the one the sweep's engine measured
# for auto at its start (what its chooser divided by) and one measured after the sweep on a finer grid.
# One intra-op thread everywhere (docs/benchmarks.md, "Replay predicts tok/s (CPU demo, 2026-12-01)").
# Run from the repository root, in the project's virtual environment: bash benchmarks/results/replay_auto_2026-12-07/cpu_pipeline.sh DIR
set -eux
D=${1:-build/replay_auto}
R=$D/results
mkdir -p "$D"
mkdir -p "$D/home"
date -u; uptime
# a fresh HOME: an empty curve cache (~/.cache/ddtree/cost_curves), so the sweep's engine measures its curve now
HOME=$(realpath "$D/home") ddtree sweep --preset demo --budget 4,16,64,auto --cpu-threads 1 --out "$R" --run demo-auto \
  2>&1 | tee "$D/sweep.log"
# budget auto's curve: the sweep's engine measured it on its first auto round (the fallback grid, not cached); its log
# line holds it
python3 - "$D" <<'PY'
import ast, json, sys
for line in open(sys.argv[1] + "/sweep.log"):
    if "cost curve measured in" in line:
        json.dump(ast.literal_eval(line[line.index("{"):].strip()), open(sys.argv[1] + "/engine_curve.json", "w"))
PY
date -u; uptime
ddtree replay curve --device cpu --cpu-threads 1 --max-batch 4 --max-len 4096 --max-budget 64 --rows 1,2,3,4 \
  --budgets 0,1,3,4,7,15,16,31,63,64 --kv-lens 64,192,512,640 --prefill-tokens 64,128,256,512 --out "$D/curve_after.json"
date -u; uptime
ddtree replay record --device cpu --cpu-threads 1 --from-run "$R/demo-auto" --top-m 64 --out "$D/trace.safetensors"
for c in engine_curve curve_after; do
  ddtree replay predict "$D/trace.safetensors" --budget 4,16,64,auto --cost-curve "$D/$c.json" --run "$R/demo-auto"
  cp "$R/demo-auto/predicted.json" "$D/predicted_$c.json"
done
ddtree report "$R/demo-auto"
date -u; uptime
