#!/bin/bash
# One device call (2026-12-06, call A): can exact mode's o_proj and down run on cuBLAS with small calls padded?
# 1. The probe: for pads R of 16-256 rows, the first row count (1..2048) whose rows differ from the R-row call's,
#    and us a call of F.linear, the Triton matmul and each passing pad at the engine's row counts.
# 2. DDTree 16's price at C = 8 and 64 (1k), the engine's start-up check with its pads (models.exact_blas.PAD_ROWS)
#    and without (PAD_ROWS="", as before), each in its own process; exact mode's AR at C = 1 is the reference.
# 3. The GPU tests of the check and of exact engines (graphed rounds against AR alone, bit for bit).
# Run from the repository root with OUT set: bash benchmarks/results/blas_pad_2026-12-06/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
here=benchmarks/results/blas_pad_2026-12-06
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "$OUT/probe"
timeout 110 python3 benchmarks/cublas_chunk_probe.py --out "$OUT/probe" --pad 2>&1 | tee "$OUT/probe/probe.log"
echo "probe done at ${SECONDS}s"
run() {  # run NAME SECONDS [env...]
  local name=$1 secs=$2; shift 2
  mkdir -p "$OUT/$name"
  env "$@" timeout "$secs" python3 "$here/pad_rule.py" --out "$OUT/$name" --time-budget "$(( secs - 60 ))" \
    --cells ddtree:16:8:1024,ddtree:16:64:1024 >"$OUT/$name/exact_mode.log" 2>&1 || echo "$name failed or timed out"
  echo "$name at ${SECONDS}s:"; grep '^|' "$OUT/$name/exact_mode.log" | tail -n +3 | cut -c1-220
  python3 - "$OUT/$name/exact_mode.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps(d.get("engines", {}).get("exact", d.get("engines")))[:600])
for c in d["cells"]:
    print(c["mode"], c["method"], c["budget"], c["concurrency"], f"round {c['round_ms']:.2f} ms, prefills done "
          f"{c['prefills_done_s']:.2f} s, stages", {k: round(v, 2) for k, v in c["stage_ms_per_round"].items()})
PY
}
run pad 215
run nopad 215 PAD_ROWS=
timeout $(( 595 - SECONDS )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_exact_check.py \
  tests/engine/test_follow_up_joiners.py tests/engine/test_mixed_rounds.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
echo "all done at ${SECONDS}s"
