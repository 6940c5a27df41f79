#!/bin/bash
# One intra-op thread everywhere (the shared 2-core box: docs/benchmarks.md, "Where a CPU round's time goes").
# Curve before, the sweep, curve after; the trace of the same prompts (same preset and seed) from pipeline.sh.
set -x
cd /work/main
export PYTHONPATH=build/snap-predict2/src
PY="/tmp/venv/bin/python -c 'from ddtree.cli import main; main()'"
R=build/predict/results
CURVE="replay curve --device cpu --cpu-threads 1 --max-batch 4 --max-len 4096 --max-budget 64 --rows 1,2,3,4 --budgets 0,4,15,16,64 --kv-lens 64,192,512,640 --prefill-tokens 64,128,256,512"
date -u; uptime
eval $PY $CURVE --out build/predict/curve-t1b-before.json
date -u; uptime
eval $PY sweep --preset demo --cpu-threads 1 --out $R --run demo-sweep-t1b
date -u; uptime
eval $PY $CURVE --out build/predict/curve-t1b-after.json
date -u; uptime
