#!/bin/bash
# One device call (2026-12-04): graphed mixed rounds after the mend of git f7978e4 (a chunk's last_index was
# made outside its graph and held by nothing, so the graph read freed memory: call C's device assert). The
# exact-mode mixed-round GPU test, then C = 64 at 1k (AR, chain, b7; call B has the same cells without mixing).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
timeout 60 python3 -m pytest -q -x -m gpu tests/engine/test_mixed_rounds.py -p no:cacheprovider > "$OUT/t.log" 2>&1
tail -2 "$OUT/t.log" | cut -c1-300
echo "tests done at ${SECONDS}s"
timeout $(( 195 - SECONDS )) python3 benchmarks/gpu.py --out "$OUT/m256" --no-hf --contexts 1024 --concurrency 64 \
  --budgets 7 --waves 4 --mixed-chunk 256 --time-budget 100 > "$OUT/m256.log" 2>&1 || echo "gpu.py failed or timed out"
grep "^| 64" "$OUT/m256.log" | cut -d'|' -f1-6,10-12 | head -6
grep -c "device-side assert" "$OUT/m256.log"
echo "all done at ${SECONDS}s"
