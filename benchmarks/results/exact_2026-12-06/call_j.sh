#!/bin/bash
# One device call (2026-12-06, call J): small last tiles (ATTN_SMALL_TAIL_ROWS, attention_small_tail): where a call's
# queries fill several programs and the last holds at most 16 folded rows (DDTree 16's 17th node at G = 4), that
# program runs as a 16-row one; extra rows (call I) now only where their grid launches split at 64-255 rows x KV heads (C = 8-31).
# GPU tests; exact attention on the 17-node tree at C = 1-64 (the tune's default column now with the visibility
# packed once, as the engine calls it); the same at C = 8 with the L2 evicted before each call; then DDTree 16's
# price at C = 8 and 64 (1k) with the new rule and with the rule before both (EXTRA_ROWS=0 SMALL_TAIL_ROWS=0).
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_j.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
here=benchmarks/results/exact_2026-12-06
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider \
  -k "extra or small or tree_node" 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
shapes="served tree 17 C=8,served tree 17 C=64,served tree 17 C=1,served tree 17 C=16,served tree 17 C=32"
timeout 150 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 64 --extra-warps 4 \
  --shapes "$shapes" 2>&1 | tee "$OUT/attention_small.log" | sed -E 's/_us=/=/g' | cut -c1-600
echo "attention tune done at ${SECONDS}s"
mkdir -p "$OUT/cold"
timeout 60 python3 benchmarks/exact_attention_tune.py --out "$OUT/cold" --large-block-m 64 --cold-l2 256 \
  --shapes "served tree 17 C=8" 2>&1 | tee "$OUT/cold/attention_cold.log" | sed -E 's/_us=/=/g' | cut -c1-600
echo "cold tune done at ${SECONDS}s"
run() {  # run NAME SECONDS [env...]
  local name=$1 secs=$2; shift 2
  mkdir -p "$OUT/$name"
  env "$@" timeout "$secs" python3 "$here/extra_rule.py" --out "$OUT/$name" --time-budget "$(( secs - 45 ))" \
    --cells ddtree:16:8:1024,ddtree:16:64:1024 >"$OUT/$name/exact_mode.log" 2>&1 || echo "$name failed or timed out"
  echo "$name at ${SECONDS}s:"; grep '^|' "$OUT/$name/exact_mode.log" | tail -n +3 | cut -c1-220
  python3 - "$OUT/$name/exact_mode.json" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["cells"]:
    if c["method"] == "ddtree":
        print(c["mode"], c["budget"], c["concurrency"], f"round {c['round_ms']:.2f} ms, prefills done "
              f"{c['prefills_done_s']:.2f} s, stages", {k: round(v, 2) for k, v in c["stage_ms_per_round"].items()})
PY
}
each=$(( (590 - SECONDS) / 2 ))
run new "$each"
run old $(( 590 - SECONDS )) EXTRA_ROWS=0 SMALL_TAIL_ROWS=0
echo "all done at ${SECONDS}s"
