#!/bin/bash
# One device call (2026-12-06, call E): the kernels of git ab285e7 (shared chunk and shared-tile helpers, the chunk
# programs' last split clamped) on a GPU for the first time. The exact kernels' GPU tests; exact attention for the
# trees served at 16-64 in flight in 64- and 128-row programs at 4 and 8 warps (a served 17-node tree at C = 64
# takes two 64-row programs a row and KV head, the second re-reading the prefix for one query); then exact mode's
# price at C = 64 (the chain, DDTree 16) and in the C = 8 cells that take the split launch (the chain, DDTree 4
# and 16), each row now with where its wall time went (prefills, stages).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_e.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider 2>&1 | tail -4 \
  | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
shapes="served tree 17 C=64,served tree 17 C=32,served tree 17 C=16,served tree 32 C=64,served tree 9 C=64,chain C=64,served tree 64 C=8"
timeout 170 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 64,128 --large-warps 8 \
  --shapes "$shapes" 2>&1 | tee "$OUT/attention_block_m.log" | sed -E 's/_us=/=/g' | cut -c1-400
echo "attention tune done at ${SECONDS}s"
mkdir -p "$OUT/exact"
left=$(( 585 - SECONDS ))
timeout "$left" python3 benchmarks/exact_mode.py --out "$OUT/exact" --time-budget "$(( left - 40 ))" \
  --cells dflash:0:64:1024,ddtree:16:64:1024,dflash:0:8:1024,ddtree:4:8:1024,ddtree:16:8:1024 \
  >"$OUT/exact/exact_mode.log" 2>&1 || echo "exact_mode failed or timed out"
grep '^|' "$OUT/exact/exact_mode.log" | cut -c1-220
python3 - "$OUT/exact/exact_mode.json" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["cells"]:
    print(c["mode"], c["method"], c["budget"], c["concurrency"], f"wall {c['wall_s']:.2f} s, prefills done "
          f"{c['prefills_done_s']:.2f} s, ttft {c['ttft_s_mean']:.2f} s, round {c['round_ms']:.2f} ms, stages",
          c["stage_ms_per_round"])
PY
echo "all done at ${SECONDS}s"
