#!/bin/bash
# The demo numbers: the sweep, then a cost curve on the sweep's engine config, a trace of the sweep's own prompts,
# and replay's prediction written into the run directory. One process at a time (2 shared cores).
set -x
cd /work/main
export PYTHONPATH=build/snap-predict/src
PY="/tmp/venv/bin/python -c 'from ddtree.cli import main; main()'"
R=build/predict/results
date -u
uptime
eval $PY sweep --preset demo --out $R --run demo-sweep-2
date -u; uptime
eval $PY replay curve --device cpu --max-batch 4 --max-len 4096 --max-budget 64 --rows 1,2,3,4 --budgets 0,4,15,16,64 --kv-lens 64,192,512,640 --prefill-tokens 64,128,256,512 --out build/predict/curve.json
date -u; uptime
eval $PY replay record --device cpu --from-run $R/demo-sweep-2 --out build/predict/trace.safetensors
date -u; uptime
eval $PY replay predict build/predict/trace.safetensors --budget 4,16,64 --cost-curve build/predict/curve.json --run $R/demo-sweep-2
date -u
