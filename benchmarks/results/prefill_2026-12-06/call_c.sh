#!/bin/bash
# Call C: the split launch's tree tails resume from the state their query tile's program hands over (a second launch
# of chunk programs) instead of re-reading the shared tiles of the split holding start. GPU tests of the exact
# attention; the tune against the kernel before (build/batch_invariant_before.py = git be39f86's, carried); the price
# of the cells that take the split launch with trees (one request; DDTree 16 at C = 8).
# Run from the repository root with OUT set: bash benchmarks/results/prefill_2026-12-06/call_c.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/test_batch_invariant.py \
  -k "not launch and not linear and not waves" 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
echo "tests done at ${SECONDS}s"
timeout 150 python3 benchmarks/exact_attention_tune.py --out $OUT/tune --bucket --stagger 256 \
  --ref build/batch_invariant_before.py 2>&1 | grep -v Warn | tee "$OUT/tune.log" \
  | python3 -c "
import sys
for line in sys.stdin:
    kv = dict(p.split('=', 1) for p in line.strip().split(' | ') if '=' in p)
    if 'shape' in kv:
        print(kv['shape'], 'default', kv.get('default_us'), 'exact', kv.get('exact_us'), 'single', kv.get('exact_single_us'),
              'split', kv.get('exact_split_us'), 'ref', kv.get('exact_ref_us'), 'same', kv.get('ref_same_bits'),
              'fused=split', kv.get('fused_same_bits'), '=AR', kv.get('nodes_equal_to_ar'))
"
echo "tune done at ${SECONDS}s"
mkdir -p "$OUT/price"
timeout $(( 590 - SECONDS )) python3 benchmarks/exact_mode.py --out "$OUT/price" --time-budget $(( 520 - SECONDS )) \
  --cells ddtree:16:1:1024,ddtree:63:1:1024,ddtree:16:8:1024 >"$OUT/price/exact_mode.log" 2>&1 || echo "price failed or timed out"
grep '^|' "$OUT/price/exact_mode.log" | tail -n +3 | cut -c1-220
python3 - "$OUT/price/exact_mode.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["cells"]:
    print(c["mode"], c["method"], c["budget"], c["concurrency"], f"round {c['round_ms']:.2f} ms, stages",
          {k: round(v, 2) for k, v in c["stage_ms_per_round"].items()})
PY
echo "all done at ${SECONDS}s"
