#!/bin/bash
# One device call (2026-12-06, call C): the split launch's tree tails one program per chunk (git after 0ddc0e2).
# The exact kernels' GPU tests; exact attention on the tune's shapes at the engine's key buckets beside the kernel
# of 0ddc0e2 (--ref: `git show 0ddc0e2:src/ddtree/models/batch_invariant.py > ref_0ddc0e2.py` before the call,
# not kept; bits compared on every shape); then exact mode's price at one request (the AR reference first).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
here=benchmarks/results/exact_2026-12-06
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -4 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 170 python3 benchmarks/exact_attention_tune.py --out "$OUT" --bucket --ref "$here/ref_0ddc0e2.py" 2>&1 \
  | tee "$OUT/attention_tune.log" | sed -E 's/ \| (rows|tokens|context)=[0-9]+//g' | cut -c1-330
echo "attention tune done at ${SECONDS}s"
mkdir -p "$OUT/exact"
left=$(( 585 - SECONDS ))
timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 40 ))" \
  --cells ddtree:63:1:1024,ddtree:16:1:1024,dflash:0:1:1024,ar:0:1:4096,ddtree:32:1:4096 >"$OUT/exact/exact_mode.log" 2>&1 \
  || echo "exact_mode failed or timed out"
grep '^|' "$OUT/exact/exact_mode.log" | cut -c1-220
echo "all done at ${SECONDS}s"
