#!/bin/bash
# One device call (2026-12-06, call F): where exact mode's verify time goes in the cells call E left furthest below
# 90 % (the chain and DDTree 16 at C = 64; DDTree 16 at C = 8): profiles of served rounds in both modes (the kernel
# of git ab285e7). The engine's own prefill chunk (512): a 4096-token chunk makes exact mode's start-up check
# multiply 64 x 4096 rows (the out-of-memory of 2026-12-05, call B); 1024 new tokens so that rounds run after the
# last prompt's first token.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_f.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
prof() {  # prof NAME METHODS CONCURRENCY SECONDS [profile_rounds.py flags...]
  local name=$1 methods=$2 conc=$3 secs=$4; shift 4
  timeout "$secs" python3 benchmarks/profile_rounds.py --out "$OUT/$name" --methods "$methods" --concurrency "$conc" \
    --context 1024 "$@" > "$OUT/$name.log" 2>&1 || echo "profile $name failed or timed out"
  echo "$name done at ${SECONDS}s"
  grep "still allocated\|Error" "$OUT/$name.log" | head -5
  grep -E "^### |^decode under|^\| \`" "$OUT/$name/profile_rounds.md" | head -40 | cut -c1-200
}
prof c64 dflash,ddtree-16 64 380 --new-tokens 1024 --prefill-chunk 512
prof c8 ddtree-16 8 $(( 585 - SECONDS )) --new-tokens 512 --prefill-chunk 1024
echo "all done at ${SECONDS}s"
