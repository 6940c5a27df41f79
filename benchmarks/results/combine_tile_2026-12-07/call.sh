#!/bin/bash
# Does tree attention's combine over the tiles of tuning.choose_combine_tile (no register spills) remove the step the
# cost curves show at 16-32 tree rows over 3-4k keys? Times the kernel at those shapes (and at decode over long
# contexts) with the default tile (the split's rows, 64 columns: tuning.COMBINE_BLOCK_M/_D) and with the rule's,
# and if the rule is >= 10 % faster at any shape of T >= 16, runs the C = 1 / 4k cell of the matrix (part c1k4)
# with the rule and with the default; if not, runs the C = 32 long-context part again (long32: the prefill-context
# pricing on its 8k cell). TOTAL_S (590) bounds the call, KERNEL_S (70) the kernel timing.
# Run from the repository root with OUT set: bash benchmarks/results/combine_tile_2026-12-07/call.sh
# Ran on one H100 at git 5dce4e7 (docs/benchmarks.md, "Tree attention's combine tile on the H100"); since git 9964f1e
# the rule is the default, so at later commits this script compares the rule with itself.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
MATRIX=benchmarks/results/matrix_2026-12-07/call.sh
python3 benchmarks/tree_attention.py --out "$OUT/ta.json" --time-budget ${KERNEL_S:-70} \
  --shapes 16:4096:1,32:4096:2,16:4096:4,32:4096:4,16:8192:1,32:8192:1,8:4096:1,1:8192:1,1:4096:8,17:1024:1 \
  --combine-tiles rule --block-m 16,64 --block-n 64 --warps 4 --stages 3 --splits none 2>&1 | grep -v Warning | tee "$OUT/ta.log"
gain=$(python3 - "$OUT/ta.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
ratios = [r["combine_ms"]["rule"] / r["default_ms"] for r in rows if r["t"] >= 16 and "rule" in r["combine_ms"]]
print("yes" if ratios and min(ratios) <= 0.9 else "")
PY
)
echo "== kernel done at ${SECONDS}s; the rule's tile >= 10 % faster somewhere: '${gain}'"
if [ -n "$gain" ]; then
  OUT=$OUT/rule PARTS=c1k4 EXTRA="--combine-rule" bash $MATRIX
  OUT=$OUT/default PARTS=c1k4 LIMIT=$((${TOTAL_S:-590} - SECONDS)) bash $MATRIX
else
  OUT=$OUT PARTS=long32 LIMIT=$((${TOTAL_S:-590} - SECONDS)) bash $MATRIX
fi
echo "all done at ${SECONDS}s"
