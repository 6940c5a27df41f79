#!/bin/bash
# The matrix of issue 23 (C in 1, 8, 32, 64 x contexts 60, 1k, 4k, 8k) on one code version: AR, the DFlash chain,
# fixed budgets and budget auto measured in every cell, and replay's prediction of each (benchmarks/replay_h200.py
# --auto; the Qwen3-8B stand-in, bf16, CUDA graphs, greedy, 256 new tokens, the cost curve measured at start).
# One engine per part (its slots sized by the part's largest C and context). Run from the repository root with OUT
# set; PARTS picks the parts: bash benchmarks/results/matrix_2026-12-07/call.sh   (PARTS="short long1" ...);
# EXTRA adds flags to every part (EXTRA="--combine-block-m 16": PARTS=c1long again with tree attention's combine over
# 16-row tiles, against the default's; c1k4: its 4k cell alone). long64h (an H200 only: C = 64 at 8k needs about 113
# GiB) runs C = 64 at 4k and 8k with the 1024-token prefill chunk both need; short64 the C = 64 cells at 60 and 1k
# (as benchmarks/results/replay_auto_2026-12-07/call.sh ran them on the H100). The whole matrix on an H200 is five
# calls (short, short64, long1, long32, long64h: about 2800 s of device time with their limits), more than one
# session's 1800 s: short and short64 in one session (a call each), long1, long32 and long64h in one or two more.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
declare -A CONTEXTS=([short]=60,1024 [long1]=4096,8192 [long32]=4096,8192 [long64]=4096 [c32k1]=1024 [c1long]=4096,8192 [c1k4]=4096 [long64h]=4096,8192 [short64]=60,1024)
declare -A CONC=([short]=1,8,32 [long1]=1,8 [long32]=32 [long64]=64 [c32k1]=32 [c1long]=1 [c1k4]=1 [long64h]=64 [short64]=64)
declare -A BUDGETS=([short]=7,15,31 [long1]=3,15,31 [long32]=3,7,15 [long64]=7 [c32k1]=7 [c1long]=7,15,31 [c1k4]=7,15,31 [long64h]=7 [short64]=3,7)
declare -A WAVES=([short]=4 [long1]=4 [long32]=1 [long64]=1 [c32k1]=4 [c1long]=4 [c1k4]=4 [long64h]=1 [short64]=4)
declare -A MATRIX_S=([short]=380 [long1]=330 [long32]=300 [long64]=150 [c32k1]=120 [c1long]=200 [c1k4]=110 [long64h]=330 [short64]=430)
declare -A LIMITS=([short]=585 [long1]=500 [long32]=585 [long64]=280 [c32k1]=210 [c1long]=330 [c1k4]=250 [long64h]=570 [short64]=580)
declare -A FLAGS=([long64h]="--prefill-chunk 1024")
mkdir -p "$OUT"
for part in ${PARTS:-short}; do
  echo "== $part at ${SECONDS}s"
  timeout "${LIMIT:-${LIMITS[$part]}}" python3 benchmarks/replay_h200.py --out "$OUT/$part" --contexts "${CONTEXTS[$part]}" \
    --concurrency "${CONC[$part]}" --budgets "${BUDGETS[$part]}" --auto --waves "${WAVES[$part]}" \
    --time-budget "${MATRIX_S[$part]}" --no-eager ${FLAGS[$part]:-} ${EXTRA:-} >"$OUT/$part.log" 2>&1 || echo "$part failed or timed out"
  grep -v "^{" "$OUT/$part.log" | grep -E '^(measured|\| graphed|\| no context|auto |total|engine ready|trace|prefill points after)' | cut -c1-220
done
echo "all done at ${SECONDS}s"
