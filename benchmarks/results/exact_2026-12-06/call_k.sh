#!/bin/bash
# One device call (2026-12-06, call K): the exact-attention tune with rows at different lengths (--stagger 256: each
# row starts 0-255 positions past the 1k context, as requests do in the engine's rounds), the tails as the engine's
# forward lays them out (engine_tail), for the rules of calls I and J (extra rows, small last tiles) against the rule
# before them: their tune gains at starts of exactly 1024 did not move the engine's verify stage.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_k.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
shapes="served tree 17 C=8,served tree 17 C=64,served tree 17 C=16,served tree 17 C=1,served tree 64 C=8,chain C=8"
timeout 300 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 64 --extra-warps 4 --stagger 256 \
  --shapes "$shapes" 2>&1 | tee "$OUT/attention_stagger.log" | sed -E 's/_us=/=/g' | cut -c1-600
echo "all done at ${SECONDS}s"
