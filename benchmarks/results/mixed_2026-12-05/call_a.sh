#!/bin/bash
# One device call (2026-12-05): mixed rounds queued before the round in flight is read (a follow-up carries the
# riders' chunks; their first tokens read once that round is read), against the scheduler before (git db01927,
# whose riders sent every next round to a host launch, carried in .ab/), in one call: C = 64, context 60, four
# waves, AR / chain / b7 / budget auto, mixed chunk 2048 (as large as a prefill step) and mixing off. First the
# exact-mode GPU tests of mixed rounds and joiners.
# Before it, on the development machine: mkdir -p .ab && git show db01927:src/ddtree/engine/scheduler.py >
# .ab/scheduler_db01927.py (.ab/ ignored; the old scheduler is self-contained, so it runs over today's other modules).
# Run from the repository root with OUT set and .ab carried: bash benchmarks/results/mixed_2026-12-05/call_a.sh
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -m gpu tests/engine/test_mixed_rounds.py \
  tests/engine/test_follow_up_joiners.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log" | cut -c1-300
echo "tests done at ${SECONDS}s"
rm -rf /tmp/before && cp -r src /tmp/before && cp .ab/scheduler_db01927.py /tmp/before/ddtree/engine/scheduler.py
run() {  # run NAME SRC MIXED SECONDS
  PYTHONPATH=$2 timeout "$4" python3 benchmarks/gpu.py --out "$OUT/$1" --no-hf --auto --contexts 60 \
    --concurrency 64 --budgets 7 --waves 4 --mixed-chunk "$3" --time-budget $(( $4 - 30 )) > "$OUT/$1.log" 2>&1 \
    || echo "gpu.py ($1) failed or timed out"
  echo "$1 done at ${SECONDS}s"
  grep "^| 64" "$OUT/$1.log" | cut -d'|' -f1-6,10-12 | head -6
  grep -c "failed in its CUDA graphs" "$OUT/$1.log"
}
run m2048 "$PWD/src" 2048 $(( (570 - SECONDS) / 3 + 5 ))
run m0 "$PWD/src" 0 $(( (570 - SECONDS) / 2 + 5 ))
run m2048_before /tmp/before 2048 $(( 575 - SECONDS ))
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
