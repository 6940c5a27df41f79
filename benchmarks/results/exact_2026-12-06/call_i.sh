#!/bin/bash
# One device call (2026-12-06, call I): extra rows (ATTN_EXTRA_ROWS, attention_extra): a served 17-node tree at G = 4
# (68 folded rows, DDTree 16) in one program of 64 + 16 rows a row and KV head, its prefix read once, where two
# 64-row or three 32-row programs read it two or three times. Their GPU tests (bits against programs without them
# and against AR steps); exact attention on the 17-node tree at C = 1-64 with and without them at 4 and 8 warps;
# then DDTree 16's price at C = 8 and 64 (1k) with them (4 warps) and without (EXTRA_ROWS=0), each in its own process.
# Run from the repository root with OUT set: bash benchmarks/results/exact_2026-12-06/call_i.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
here=benchmarks/results/exact_2026-12-06
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python3 -m pytest -q -m gpu tests/models/test_batch_invariant.py -p no:cacheprovider \
  -k "extra or tree_node or fused_launch" 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
shapes="served tree 17 C=8,served tree 17 C=64,served tree 17 C=1,served tree 17 C=16,served tree 17 C=32"
timeout 140 python3 benchmarks/exact_attention_tune.py --out "$OUT" --large-block-m 64 --extra-warps 4,8 \
  --shapes "$shapes" 2>&1 | tee "$OUT/attention_extra.log" | sed -E 's/_us=/=/g' | cut -c1-500
echo "attention tune done at ${SECONDS}s"
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
run extra "$each" EXTRA_ROWS=16
run noextra $(( 590 - SECONDS )) EXTRA_ROWS=0
echo "all done at ${SECONDS}s"
