#!/bin/bash
# One device call (2026-12-06, after call_a.sh and the rule it led to: 64-row programs from 64 folded rows up where
# that grid launches fused). The exact kernels' GPU tests; exact attention in 32- and 64-row programs on more served
# shapes (C = 8-64) with the engine's rule timed on its own; then exact mode's price of DDTree 16 at C = 64, 1k with
# the threshold as before (old_rule.py) and as now, each in its own process (the AR reference at C = 1 first in each).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 180 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -6 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 150 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 32,64 2>&1 \
  | tee "$OUT/attention_block_m.log" | cut -c1-420
echo "attention tune done at ${SECONDS}s"
for rule in old new; do
  mkdir -p "$OUT/$rule"
  if [ "$rule" = old ]; then
    left=$(( (585 - SECONDS) / 2 )); script=benchmarks/results/exact_2026-12-06/old_rule.py
  else
    left=$(( 585 - SECONDS )); script=benchmarks/exact_mode.py
  fi
  timeout "$left" python3 "$script" --out "$OUT/$rule" --time-budget "$(( left - 40 ))" \
    --cells ddtree:16:64:1024 >"$OUT/$rule/exact_mode.log" 2>&1 || echo "$rule: exact_mode failed or timed out"
  echo "$rule rule:"; grep '^|' "$OUT/$rule/exact_mode.log" | cut -c1-220
done
echo "all done at ${SECONDS}s"
