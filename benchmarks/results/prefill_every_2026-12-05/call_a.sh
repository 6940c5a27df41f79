#!/bin/bash
# One device call (written 2026-12-05, not run that day: no device was lent): EngineConfig.prefill_every, arrivals
# sharing prefill steps while others decode, against every round (the default), in one call: C = 64, contexts 60
# and 1k, four waves, AR / chain / b7 / budget auto. Issue 23: at context 60 a DDTree round was 2.7 ms past its
# device stages, inferred to be the ~127 prefill steps of one 60-token arrival each (docs/benchmarks.md, "Rounds
# that take in newcomers"); with N = 3 they should come in about a third as many steps, each newcomer waiting at
# most 3 rounds for its first token.
# Run from the repository root with OUT set: bash benchmarks/results/prefill_every_2026-12-05/call_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
run() {  # run EVERY CONTEXTS SECONDS
  timeout "$3" python3 benchmarks/gpu.py --out "$OUT/e$1" --no-hf --auto --contexts "$2" --concurrency 64 \
    --budgets 7 --waves 4 --prefill-every "$1" --time-budget $(( $3 - 40 )) > "$OUT/e$1.log" 2>&1 \
    || echo "gpu.py (prefill every $1) failed or timed out"
  echo "every $1 done at ${SECONDS}s"
  grep "^| 64" "$OUT/e$1.log" | cut -d'|' -f1-6,10-12 | head -10
}
run 3 60,1024 270
run 1 60,1024 $(( 575 - SECONDS ))
rm -f "$OUT"/*/gpu.md "$OUT"/*/cost_curve.json
echo "all done at ${SECONDS}s"
