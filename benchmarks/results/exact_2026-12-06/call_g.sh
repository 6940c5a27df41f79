#!/bin/bash
# One device call (2026-12-06, call G): one 128-row, 8-warp program for a whole tree of 17-32 nodes at small
# concurrency (ATTN_WIDE_*, git after ab285e7, off by default). Exact attention on the served trees of 17 and 32
# nodes at C = 1-16 in 32-, 64- and 128-row programs at 4 and 8 warps (bits against 32-row programs); then DDTree
# 16's price at C = 8 (1k) with the engine's rule and with wide programs (wide_rule.py: 64 to 128 rows x KV heads,
# i.e. C = 8 and 16, fused and not), each in its own process.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_g.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
here=benchmarks/results/exact_2026-12-06
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
shapes="served tree 17 C=8,served tree 32 C=8,served tree 17 C=1,served tree 32 C=1,served tree 17 C=16"
timeout 150 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 64,128 --large-warps 8 \
  --shapes "$shapes" 2>&1 | tee "$OUT/attention_block_m.log" | sed -E 's/_us=/=/g' | cut -c1-400
echo "attention tune done at ${SECONDS}s"
run() {  # run NAME SECONDS SCRIPT [env...]
  local name=$1 secs=$2 script=$3; shift 3
  mkdir -p "$OUT/$name"
  env "$@" timeout "$secs" python3 "$script" --out "$OUT/$name" --time-budget "$(( secs - 40 ))" \
    --cells ddtree:16:8:1024 >"$OUT/$name/exact_mode.log" 2>&1 || echo "$name failed or timed out"
  echo "$name at ${SECONDS}s:"; grep '^|' "$OUT/$name/exact_mode.log" | tail -n +3 | cut -c1-220
}
each=$(( (585 - SECONDS) / 3 ))
run rule "$each" benchmarks/exact_mode.py
run wide_fused "$each" "$here/wide_rule.py" WIDE_MAX_PER_TILE=128 WIDE_FUSED=1
run wide_split $(( 585 - SECONDS )) "$here/wide_rule.py" WIDE_MAX_PER_TILE=128 WIDE_FUSED=0
echo "all done at ${SECONDS}s"
