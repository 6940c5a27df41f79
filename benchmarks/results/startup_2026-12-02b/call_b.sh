#!/bin/bash
# One device call (2026-12-02, after call_a.sh): `--warmup full` on an empty and then a warm Triton cache with the
# demo tokenizer loaded through its class (git of this run), then exact mode's price table at ATTN_SPLIT_KEYS 512.
# Run from the repository root with OUT set: bash benchmarks/results/startup_2026-12-02b/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
export TRITON_CACHE_DIR=/tmp/ddtree-triton-fresh-b
timeout 150 python3 benchmarks/first_request.py --out "$OUT/cold_full" --warmup full --no-workloads \
  >"$OUT/cold_full.log" 2>&1 || echo "cold_full failed"
grep -E "ready in" "$OUT/cold_full.log" | cut -c1-200; echo "cold done at ${SECONDS}s"
timeout 100 python3 benchmarks/first_request.py --out "$OUT/warm_full" --warmup full --no-workloads \
  >"$OUT/warm_full.log" 2>&1 || echo "warm_full failed"
grep -E "ready in" "$OUT/warm_full.log" | cut -c1-200; echo "warm done at ${SECONDS}s"
for f in cold_full warm_full; do
  python3 -c "import json; s=json.load(open('$OUT/$f/first_request.json'))['startup']; s.pop('compiles_during_start'); print('$f', s)" 2>/dev/null
done
mkdir -p "$OUT/exact"
timeout "$(( 592 - SECONDS ))" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( 530 - SECONDS ))" \
  >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed"
tail -24 "$OUT/exact/exact_mode.log" | cut -c1-220
