#!/bin/bash
# One device call (2026-12-06, call D, after call C): the tune of call C with each shape also timed on a chunk per
# query (single_chunks) and the two tables' own cost; then exact mode's price at one request with the forward's
# tails a chunk per query where the split launch runs (bi.groups_tails) and, in its own process, grouped as in call
# C (grouped_tails.py); the AR reference first in each.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_d.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
here=benchmarks/results/exact_2026-12-06
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 benchmarks/exact_attention_tune.py --out "$OUT" --bucket 2>&1 | tee "$OUT/attention_tune.log" \
  | sed -E 's/ \| (rows|tokens|context|kv_len)=[0-9]+//g; s/ \| exact_fused_s3_us=[0-9.]+//' | cut -c1-330
echo "attention tune done at ${SECONDS}s"
cells=ddtree:63:1:1024,ddtree:16:1:1024,ar:0:1:4096,ddtree:32:1:4096
for run in single grouped; do
  mkdir -p "$OUT/$run"
  if [ "$run" = single ]; then
    left=$(( (585 - SECONDS) / 2 )); script=benchmarks/exact_mode.py
  else
    left=$(( 585 - SECONDS )); script=$here/grouped_tails.py
  fi
  timeout "$left" python3 "$script" --out "$OUT/$run" --time-budget "$(( left - 30 ))" --cells "$cells" \
    >"$OUT/$run/exact_mode.log" 2>&1 || echo "$run: exact_mode failed or timed out"
  echo "$run:"; grep '^|' "$OUT/$run/exact_mode.log" | cut -c1-220
done
echo "all done at ${SECONDS}s"
