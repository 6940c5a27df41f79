#!/bin/bash
# Call B: the matmul table's new edges (128 x 128 tiles for 257-512 rows, 128 x 256 past 512) on the GPU tests and the
# down tune; the tail chunks' dot rows (16, 32, 64) on served trees; the price of the C = 64 cells.
# Run from the repository root with OUT set: bash benchmarks/results/prefill_2026-12-06/call_b.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/test_batch_invariant.py \
  -k "launch or linear or waves" 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 60 python3 benchmarks/exact_matmul_tune.py --out $OUT/down --weights down --splits 4 --cublas-rows 0 \
  --rows 256,384,512,544,640,768,1024,1088,1536,2048 --launches default 2>&1 | grep "^| down"
echo "down done at ${SECONDS}s"
timeout 170 python3 benchmarks/exact_attention_tune.py --out $OUT/tail --tail-rows 16,32,64 --stagger 256 \
  --shapes "served tree 17 C=64,served tree 9 C=64,served tree 32 C=64,served tree 17 C=16,served tree 64 C=8" 2>&1 \
  | grep -v Warn | tail -8
echo "tail done at ${SECONDS}s"
mkdir -p "$OUT/price"
timeout $(( 590 - SECONDS )) python3 benchmarks/exact_mode.py --out "$OUT/price" --time-budget $(( 520 - SECONDS )) \
  --cells dflash:0:64:1024,ddtree:8:64:1024,ddtree:16:64:1024 >"$OUT/price/exact_mode.log" 2>&1 || echo "price failed or timed out"
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
