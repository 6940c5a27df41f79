#!/bin/bash
# Does tree attention's combine over 16- or 32-row tiles (ddtree.tuning.COMBINE_BLOCK_M) remove the step the cost
# curves show at 16-32 tree rows over 3-4k keys? Times the kernel at those shapes, and if a tile is >= 10 % faster at
# any of them, runs the C = 1 / 4k cell of the matrix (part c1k4) with the default combine and with that tile; if
# not, runs the C = 32 long-context part again (long32: the prefill-context pricing on its 8k cell).
# Run from the repository root with OUT set: bash benchmarks/results/combine_tile_2026-12-07/call.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
MATRIX=benchmarks/results/matrix_2026-12-07/call.sh
python3 benchmarks/tree_attention.py --out "$OUT/ta.json" --time-budget 100 \
  --shapes 8:4096:1,16:4096:1,32:4096:1,32:4096:2,16:4096:4,32:4096:4,16:8192:1,32:8192:1 \
  --combine-block-m 16,32 --block-m 64 --block-n 64 --warps 4 --stages 3 --splits none 2>&1 | grep -v Warning | tee "$OUT/ta.log"
tile=$(python3 - "$OUT/ta.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
best = {}
for r in rows:
    for m, ms in r["combine_ms"].items():
        if r["t"] >= 16:
            best.setdefault(m, []).append(ms / r["default_ms"])
gains = {m: min(v) for m, v in best.items()}
print(min(gains, key=gains.get) if gains and min(gains.values()) <= 0.9 else "")
PY
)
echo "== kernel done at ${SECONDS}s; tile chosen: '${tile}'"
if [ -n "$tile" ]; then
  OUT=$OUT/default PARTS=c1k4 bash $MATRIX
  OUT=$OUT/combine$tile PARTS=c1k4 EXTRA="--combine-block-m $tile" LIMIT=$((590 - SECONDS)) bash $MATRIX
else
  OUT=$OUT PARTS=long32 LIMIT=$((590 - SECONDS)) bash $MATRIX
fi
echo "all done at ${SECONDS}s"
