#!/bin/bash
# One device call (2026-12-06, call B): the Triton matmul's calls past one wave of wide tiles split into whole waves
# plus a rest (batch_invariant.linear, matmul_wave_rows), with o_proj padded to cuBLAS (call A).
# 1. GPU tests of the matmul launches (every row at every row count 1..2048, the default launch included).
# 2. The probe again (us a call of F.linear, the Triton matmul and the pads, now with the split past 1024 rows).
# 3. DDTree 16's price at C = 8 and 64 (1k); exact mode's AR at C = 1 is the reference.
# Run from the repository root with OUT set: bash benchmarks/results/blas_pad_2026-12-06/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/test_batch_invariant.py \
  -k "launch or linear or waves" 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
mkdir -p "$OUT/probe"
timeout 90 python3 benchmarks/cublas_chunk_probe.py --out "$OUT/probe" --pad 2>&1 | tee "$OUT/probe/probe.log" \
  | grep -E "first failing|linear us|triton us|pad32 us"
echo "probe done at ${SECONDS}s"
mkdir -p "$OUT/price"
timeout $(( 590 - SECONDS )) python3 benchmarks/exact_mode.py --out "$OUT/price" --time-budget $(( 530 - SECONDS )) \
  --cells ddtree:16:8:1024,ddtree:16:64:1024 >"$OUT/price/exact_mode.log" 2>&1 || echo "price failed or timed out"
grep '^|' "$OUT/price/exact_mode.log" | tail -n +3 | cut -c1-220
python3 - "$OUT/price/exact_mode.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps(d["engines"].get("exact"))[:600])
for c in d["cells"]:
    print(c["mode"], c["method"], c["budget"], c["concurrency"], f"round {c['round_ms']:.2f} ms, prefills done "
          f"{c['prefills_done_s']:.2f} s, stages", {k: round(v, 2) for k, v in c["stage_ms_per_round"].items()})
PY
echo "all done at ${SECONDS}s"
