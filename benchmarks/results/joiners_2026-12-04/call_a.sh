#!/bin/bash
# One device call (2026-12-04): rounds queued before the flight is read take in newcomers (git 1285eac), against the
# scheduler before it (git b50529e, its scheduler.py carried in .ab/ and laid over a copy of src/ on the device), in
# one call: C = 64, contexts 60 and 1k, four waves, AR / chain / b7 / budget auto, mixed rounds off (the default).
# First the GPU test of joiners in exact mode (bits against AR alone, graphed rounds).
# Run from the repository root with OUT set and .ab carried: bash benchmarks/results/joiners_2026-12-04/call_a.sh
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
PYTHONPATH=$PWD/src timeout 120 python3 -m pytest -q -m gpu tests/engine/test_follow_up_joiners.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log" | cut -c1-300
echo "tests done at ${SECONDS}s"
rm -rf /tmp/before && cp -r src /tmp/before && cp .ab/scheduler_b50529e.py /tmp/before/ddtree/engine/scheduler.py
run() {  # run NAME SRC SECONDS
  PYTHONPATH=$2 timeout "$3" python3 benchmarks/gpu.py --out "$OUT/$1" --no-hf --auto --contexts 60,1024 \
    --concurrency 64 --budgets 7 --waves 4 --time-budget $(( $3 - 30 )) > "$OUT/$1.log" 2>&1 \
    || echo "gpu.py ($1) failed or timed out"
  echo "$1 done at ${SECONDS}s"
  grep "^| 64" "$OUT/$1.log" | cut -d'|' -f1-6,10-12 | head -10
}
run joiners "$PWD/src" $(( (590 - SECONDS) / 2 ))
run before /tmp/before $(( 590 - SECONDS ))
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json  # 8 files come back: the logs hold every cell's JSON too
echo "all done at ${SECONDS}s"
