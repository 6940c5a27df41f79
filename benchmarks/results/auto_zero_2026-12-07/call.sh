#!/bin/bash
# One device call, prepared on 2026-12-07: budget auto with no tree (budget 0, auto_budget.ZERO) against auto
# without it ("nozero": ZERO=0, the chooser before budget 0), fixed budgets and AR, on one engine per part
# (benchmarks/auto_ab.py; the Qwen3-8B stand-in, bf16, CUDA graphs):
#   mix   half the requests sampled at temperature 1 (rows that differ in confidence), C = 64 and 8 at 60 tokens
#   all   every request sampled at temperature 1 (no tree earns its cost), C = 64 at 60 tokens
#   code  greedy code (trees earn theirs; no tree must not cost auto there), C = 64 at 60 and 1k tokens
# On an H100 the curve is the one an H100 measured (docs/benchmarks/auto_gpu_2026-12-07b/h100_cost_curve.json);
# on another card it is measured at start (by the first part; the others read its file). Run from the repository root with OUT set; LIMIT (s, default 560);
# CURVE a curve file to divide by on any card (else as above); PARTS (default "mix all code"; "mix64", "code60": those parts at C = 64 and 60 tokens alone) the parts, in order.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SECONDS=0
LIMIT=${LIMIT:-560}
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
curve=${CURVE:-auto}
[ -z "${CURVE:-}" ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && curve=docs/benchmarks/auto_gpu_2026-12-07b/h100_cost_curve.json
part() {  # name, seconds it may take, then auto_ab.py's arguments
  local name=$1 secs=$2; shift 2
  [ "$curve" = auto ] && secs=$((secs + 90))  # the curve's measurement at start (94 s on the H100 grid)
  local left=$((LIMIT - SECONDS - 15))
  [ "$left" -lt 60 ] && { echo "$name: skipped (${left}s left)"; return; }
  [ "$secs" -gt "$left" ] && secs=$left
  timeout "$secs" python3 benchmarks/auto_ab.py --out "$OUT/$name" --cost-curve "$curve" --repeats 2 \
    --variants "zero: nozero:ZERO=0" --time-budget $((secs - 45)) "$@" > "$OUT/$name.log" 2>&1 || echo "$name: failed or timed out"
  grep -v '^{' "$OUT/$name.log" | grep -v Warning | grep '^|' | tail -12
  # a curve measured at start is measured once: the later parts divide by the first part's
  [ "$curve" = auto ] && [ -f "$OUT/$name/cost_curve.json" ] && curve=$OUT/$name/cost_curve.json
}
PARTS=${PARTS:-mix all code}
for p in $PARTS; do
  case $p in
    mix) part mix 230 --cells 64:60,8:60 --budgets 3,7 --mix-sampled 1.0 ;;
    mix64) part mix64 150 --cells 64:60 --budgets 3 --mix-sampled 1.0 ;;
    all) part all 130 --cells 64:60 --budgets 3 --mix-sampled 1.0 --sampled-share 1.0 ;;
    code) part code 180 --cells 64:60,64:1024 --budgets 7 ;;
    code60) part code60 130 --cells 64:60 --budgets 7 ;;
  esac
done
echo "all done at ${SECONDS}s"
