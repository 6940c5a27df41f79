#!/bin/bash
# Does tree attention's combine over the tiles of tuning.choose_combine_tile (no register spills) remove the step the
# cost curves show at 16-32 tree rows over 3-4k keys? Times the kernel at those shapes (and at decode over long
# contexts) with the rule's tile (the default column) and with the tile before it (128x64: the split's rows, 64
# columns), and if the rule is >= 10 % faster at any shape of T >= 16, runs the C = 1 / 4k cell of the matrix
# (part c1k4) with the rule and with the tile before; if not, runs the C = 32 long-context part again (long32: the
# prefill-context pricing on its 8k cell).
# Run from the repository root with OUT set: bash benchmarks/results/combine_tile_2026-12-07/call.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
MATRIX=benchmarks/results/matrix_2026-12-07/call.sh
python3 benchmarks/tree_attention.py --out "$OUT/ta.json" --time-budget 100 \
  --shapes 16:4096:1,32:4096:2,16:4096:4,32:4096:4,16:8192:1,32:8192:1,8:4096:1,1:8192:1,1:4096:8,17:1024:1 \
  --combine-tiles 128x64 --block-m 16,64 --block-n 64 --warps 4 --stages 3 --splits none 2>&1 | grep -v Warning | tee "$OUT/ta.log"
gain=$(python3 - "$OUT/ta.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
ratios = [r["default_ms"] / r["combine_ms"]["128x64"] for r in rows if r["t"] >= 16 and "128x64" in r["combine_ms"]]
print("yes" if ratios and min(ratios) <= 0.9 else "")
PY
)
echo "== kernel done at ${SECONDS}s; the rule's tile >= 10 % faster somewhere: '${gain}'"
if [ -n "$gain" ]; then
  OUT=$OUT/rule PARTS=c1k4 bash $MATRIX
  OUT=$OUT/before PARTS=c1k4 EXTRA="--combine-block-m 128 --combine-block-d 64" LIMIT=$((590 - SECONDS)) bash $MATRIX
else
  OUT=$OUT PARTS=long32 LIMIT=$((590 - SECONDS)) bash $MATRIX
fi
echo "all done at ${SECONDS}s"
