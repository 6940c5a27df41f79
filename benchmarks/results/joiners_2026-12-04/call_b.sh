#!/bin/bash
# One device call (2026-12-04): queued rounds take in newcomers AND drop the rows of requests that finished on the
# round read before (git dc9ac08; call A's joiners alone were refused almost every round at C = 64, where some row
# finishes nearly every round), against the scheduler before both (git b50529e, carried in .ab/), in one call:
# C = 64, context 60, four waves, AR / chain / b7 / budget auto. First the exact-mode GPU test of joiners.
# Run from the repository root with OUT set and .ab carried: bash benchmarks/results/joiners_2026-12-04/call_b.sh
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
PYTHONPATH=$PWD/src timeout 90 python3 -m pytest -q -m gpu tests/engine/test_follow_up_joiners.py -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log" | cut -c1-300
echo "tests done at ${SECONDS}s"
rm -rf /tmp/before && cp -r src /tmp/before && cp .ab/scheduler_b50529e.py /tmp/before/ddtree/engine/scheduler.py
run() {  # run NAME SRC SECONDS
  PYTHONPATH=$2 timeout "$3" python3 benchmarks/gpu.py --out "$OUT/$1" --no-hf --auto --contexts 60 \
    --concurrency 64 --budgets 7 --waves 4 --time-budget $(( $3 - 30 )) > "$OUT/$1.log" 2>&1 \
    || echo "gpu.py ($1) failed or timed out"
  echo "$1 done at ${SECONDS}s"
  grep "^| 64" "$OUT/$1.log" | cut -d'|' -f1-6,10-12 | head -6
}
run drops "$PWD/src" $(( (400 - SECONDS) / 2 + 10 ))
run before /tmp/before $(( 400 - SECONDS ))
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
