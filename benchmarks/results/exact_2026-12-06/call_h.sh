#!/bin/bash
# One device call (2026-12-06, call H): at C = 8 a served 17-node tree's attention took 68 us a call in the engine's
# rounds (call F's profile) against 55 in the tune with grouped tails (call G); the engine gives forwards that take
# the split launch a chunk per query (groups_tails). DDTree 16 and 4 at C = 8, 1k, with the engine's rule and with
# every tree forward's tails grouped (grouped_tails.py), each in its own process.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_h.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
here=benchmarks/results/exact_2026-12-06
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for run in rule grouped; do
  mkdir -p "$OUT/$run"
  if [ "$run" = rule ]; then
    left=$(( (340 - SECONDS) / 2 )); script=benchmarks/exact_mode.py
  else
    left=$(( 340 - SECONDS )); script=$here/grouped_tails.py
  fi
  timeout "$left" python3 "$script" --out "$OUT/$run" --time-budget "$(( left - 30 ))" \
    --cells ddtree:16:8:1024,ddtree:4:8:1024 >"$OUT/$run/exact_mode.log" 2>&1 || echo "$run: exact_mode failed or timed out"
  echo "$run at ${SECONDS}s:"; grep '^|' "$OUT/$run/exact_mode.log" | tail -n +3 | cut -c1-220
done
echo "all done at ${SECONDS}s"
